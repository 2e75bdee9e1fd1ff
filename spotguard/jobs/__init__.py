"""``spotguard jobs``: a kubectl-like view of TrainingJobs for the person running them.

``render`` turns TrainingJobs, their Events and pods (plain dicts, as the
apiserver sends them) into tables, JSON, YAML and the reconstructed history of
each job's attempts, without I/O; ``cli`` talks to the apiserver and storage.
"""
