"""What users run: runs filed in the store (records), sweeps in one process or on Ray workers, evaluations on tasks,
quality passes, live runs traced for the dashboard and their replays, and the tables read from stored runs."""
