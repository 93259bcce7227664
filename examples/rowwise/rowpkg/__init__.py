"""An FP8 weight format with one scale per row, its tensor subclass and its qgather adapter
(README, "Your own format")."""
