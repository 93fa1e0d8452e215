"""The slime stand-in's fixture for every test here (``slime_standin.slime_modules``)."""

from tests.integrations.slime.slime_standin import slime_modules

__all__ = ["slime_modules"]
