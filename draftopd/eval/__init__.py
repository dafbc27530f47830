"""Measuring drafters: acceptance statistics and timed runs (acceptance), the eval suite over named sets and
robustness variants (suite), attention-drift profiles (diagnose) and training-curve plots (plots)."""
