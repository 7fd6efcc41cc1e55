"""Experiments made of many runs: each a list of jobs (`jobs.Job`) run, resumed and published
by `jobs.run_job`, and a report built from the published copies only."""
