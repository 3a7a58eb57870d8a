"""A run's checkpoints: saved, verified, chosen at resume, retired and reshaped, so that a run
never loses its work and never silently becomes another run.

The rules, each kept by one file of this package:

1. **A checkpoint is complete when its manifest is there** (`manifest.py`). Every rank writes
   its DeepSpeed files and its random state into CHECKPOINTS/stepN and checksums the files it
   wrote (xxh3-128); rank 0 then writes `stepN/manifest.json` (every file's size and checksum,
   the run's identity and lineage, the layout) atomically, last, and only then points `latest`
   at it. Completeness is never inferred from `latest` or from the absence of anything.
2. **Nothing is deleted but by the run's own retention** (`folder.py`). After a save, retention
   removes the complete checkpoints of this run's lineage older than the newest
   --keep-checkpoints, never the one just written, never another lineage's. A folder that is in
   the way (an incomplete save, a checkpoint newer than the one resumed, one that failed
   verification) is moved into CHECKPOINTS/set-aside/UTC-TIME/, said in one line, and kept.
3. **Verified at resume, with a fallback** (`resume.py` plans it, `choice.py` chooses). The
   newest complete checkpoint (or --resume-from stepN) is verified by all ranks (each checks a
   share of the files: size, checksum, and a `weights_only` read of every pickle,
   `safe_load.py`); one that fails is reported, file by file, and the run resumes from the
   previous complete one of its lineage. Only damage falls back: a file the filesystem does not
   give is retried, then stops the run with nothing moved (`reads.py`); a file of other software
   versions is a refusal; with no checkpoint left the run is refused unless --fresh-start.
   --resume-from applies once (`resume_from.py`: run.json records the steps the resumed run
   wrote). Set-aside folders are never resumed or deleted. The one chosen is loaded by
   `loading.py`.
4. **The same run, or a refusal** (`identity.py`, `allowed_changes.py`). The manifest records what
   defines the stream and the model; a resume with any of it changed is refused before any
   process starts, naming each difference. A deliberate change is a new run: --init-from
   CHECKPOINT (`init_from.py`).
5. **Layout changes are planned before any process starts** (`reshard.py`), and a universal
   conversion is tied to the manifest of the checkpoint it came from.
6. **Every wait says what it waits for** (`tupe_ds.train.waits.announced`).
"""

from tupe_ds.train.checkpoint.folder import latest_step
from tupe_ds.train.checkpoint.init_from import InitPlan
from tupe_ds.train.checkpoint.resume import ResumePlan

__all__ = ["latest_step", "InitPlan", "ResumePlan"]
