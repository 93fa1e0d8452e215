"""Builders shared by the consumer tests."""

from weightbus.schemas.rollouts import Group, Sample, SampleStatus, TokenSpan

N_SAMPLES = 2


def make_group(
    group_index: int,
    versions: list[str] | list[list[str]] | None = None,
    *,
    status: SampleStatus = SampleStatus.COMPLETED,
    n: int = N_SAMPLES,
    spans: list[TokenSpan] | None = None,
) -> Group:
    """``n`` samples with ``index = group_index * 10 + i``; ``versions`` for every sample, or one list each."""
    per_sample = versions if versions and isinstance(versions[0], list) else [versions or []] * n
    samples = [
        Sample(
            index=group_index * 10 + i,
            weight_versions=list(per_sample[i]),
            status=status,
            weight_version_spans=list(spans or []),
            response="r",
            tokens=[1, 2],
            response_length=1,
        )
        for i in range(n)
    ]
    return Group(prompt_index=group_index, samples=samples, status=status)
