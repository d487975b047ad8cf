"""A library that copies a collective into its own namespace when it is imported, as many do
(`from torch.distributed import all_reduce`): wrapping torch.distributed later misses it."""

from torch.distributed import all_reduce


def average(tensor, world_size):
    all_reduce(tensor)  # site:cached
    tensor /= world_size
    return tensor
