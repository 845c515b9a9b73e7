"""Data shipped with kvbus: demo prompts and tasks, the calibration texts (``calibration_*.txt``)
and the default calibration profile."""
