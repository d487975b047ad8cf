"""What msmon writes: the torch-free vocabulary of rows and categories (records), every file
name and tag (layout), the rank's output directory (directory), and the live writing side."""
