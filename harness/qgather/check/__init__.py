"""What a rank measures of a gathered weight: comparisons against the golden and the wire."""
