"""Studies of the method: each one a command that trains its arms, reuses finished runs and
reports with the baselines its result must beat (launch/runlength_study.py)."""
