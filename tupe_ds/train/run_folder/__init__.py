"""What a run folder (--out) is apart from its checkpoints. It holds run.lock, the one job that
may use it (lock.py); run.json, what the run is, for the tools that read it (description.py);
history.jsonl, the run's one history of starts and checkpoints and the settings it recorded
(written by train/checkpoint/history.py, its settings read back by recorded_settings.py);
train_log.jsonl and tensorboard/, the logs (train/monitor.py), whose failed writes, like those of
every run file, stop every rank alike (files.py); and checkpoints/, the checkpoints themselves
(the package train/checkpoint)."""
