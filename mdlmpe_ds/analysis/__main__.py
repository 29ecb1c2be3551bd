"""``python -m mdlmpe_ds.analysis`` moved to launch/analyze.py (same arguments): say so, run nothing."""

raise SystemExit("this command moved: python launch/analyze.py mechanism|checkpoint ... (same arguments)")
