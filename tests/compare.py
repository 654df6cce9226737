"""How far a run's results are from a reference run's, shared by the multi-rank tests."""


def max_relative(values, reference):
    """The largest |a - b| / |b| over paired scalars (losses, gradient norms)."""
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference))


def weight_difference(weights, reference, by_norm=False):
    """(largest difference, tensor name) over every tensor of `reference`: max |a - b| over
    max |b|, or ||a - b|| / ||b|| with by_norm."""
    worst, worst_name = 0.0, ""
    for name, ref in reference.items():
        diff = weights[name].float() - ref.float()
        err = (diff.norm() / ref.float().norm() if by_norm else diff.abs().max() / ref.float().abs().max()).item()
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name
