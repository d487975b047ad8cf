"""The training-time machinery between the hooks and the output: the step context, the
per-step buffer of rows on the device, and what combines and hands them over at a step's end."""
