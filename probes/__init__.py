"""Probes: capture inside each rank of the job (installed as trainprof.probes).

They are activated in every worker by `trainprof wrap` (through a sitecustomize bootstrap) or by
`trainprof.session()`, write only into the run directory (trainprof.analysis.run), and must never
break, hang or measurably slow the job: every callback contains its own exceptions.
"""
