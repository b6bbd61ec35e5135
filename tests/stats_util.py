"""Goodness-of-fit helpers (no scipy): Pearson chi-square with p-values from torch."""
import torch


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square test of counts against probabilities; cells with fewer than
    `min_expected` expected counts are pooled into one cell."""
    observed = observed.double().flatten()
    expected = expected_probs.double().flatten() * observed.sum()
    small = expected < min_expected
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert torch.all(observed[~keep] == 0), "observed a zero-probability outcome"
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def two_sample_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors come from the same distribution."""
    a, b = a.double().flatten(), b.double().flatten()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    pooled = (a + b) / (na + nb)
    ea, eb = pooled * na, pooled * nb
    stat = ((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))
