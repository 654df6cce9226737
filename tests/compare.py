"""How far a run's results are from a reference run's, shared by the multi-rank tests."""

# What N ranks may differ from one process in float64. The ranks add the same numbers in
# another order, and each reordered sum of n terms moves by at most about n * 2^-53
# relative; Adam's first steps, lr * g / (|g| + eps), can magnify a gradient's relative
# error by up to |g| / eps where |g| ~ eps. In float32 the same runs differ by at most 1e-7
# in losses and 1.1e-5 in weights, 100 times the float32 unit roundoff (1.2e-7); the same
# magnification of float64's 1.1e-16 gives about 1e-14 (measured: at most 7.5e-15). 1e-10
# leaves four orders of margin for other kernels and machines, and is 10^6 times tighter than
# what a real defect gives (a lost or doubled gradient shard, stale masters, misplaced
# padding: 1e-4 and more).
FLOAT64_BOUND = 1e-10


def max_relative(values, reference):
    """The largest |a - b| / |b| over paired scalars (losses, gradient norms)."""
    return max(abs(a - b) / abs(b) for a, b in zip(values, reference))


def weight_difference(weights, reference, by_norm=False):
    """(largest difference, tensor name) over every tensor of `reference`: max |a - b| over
    max |b|, or ||a - b|| / ||b|| with by_norm. Compared in float64, so float64 runs keep
    their precision."""
    worst, worst_name = 0.0, ""
    for name, ref in reference.items():
        ref = ref.double()
        diff = weights[name].double() - ref
        err = (diff.norm() / ref.norm() if by_norm else diff.abs().max() / ref.abs().max()).item()
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name
