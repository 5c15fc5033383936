"""Shape inference: which input dimensions are dynamic, how they relate, and inputs at new sizes."""
