"""A training stage's resumable state: Orbax checkpoints of its parameters, optimizer state and logged rows.

`train.dsa.train_stage(..., resume=StageResume(directory, every, fingerprint))` saves every `every` steps and, when
`directory` already holds a checkpoint of the same stage (the same `fingerprint`: its config, seed and place in
the recipe), continues after its last saved step with the state it saved: a stage killed at step 57 of 100 with
`every=10` restarts at step 51, and its updates from there are those of an uninterrupted run (the batches are
drawn from the same seeded stream, the ones already used skipped). The last two checkpoints are kept; a finished
stage removes its directory (its weights are then the training script's checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil

FINGERPRINT = "stage.json"


class StageResume:
    """Where and how often one stage saves its state; `fingerprint` (JSON-able) names the stage's run so that a
    directory left by another run is refused instead of resumed."""

    def __init__(self, directory: str | os.PathLike, every: int, fingerprint: dict):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (steps between checkpoints), got {every!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.every = every
        self.fingerprint = json.loads(json.dumps(fingerprint))  # as it reads back

    def _manager(self):
        import orbax.checkpoint as ocp

        return ocp.CheckpointManager(os.path.join(self.directory, "steps"),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))

    def restore(self, params, opt_state) -> tuple[int, object, object, list[dict], list[dict]] | None:
        """(steps done, params, opt_state, logged rows, metrics of the steps not logged yet) of the latest
        checkpoint, shaped like the given ones; None when the directory holds none. A directory of another run is a ValueError naming both."""
        import orbax.checkpoint as ocp

        path = os.path.join(self.directory, FINGERPRINT)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            theirs = json.load(f)
        if theirs != self.fingerprint:
            raise ValueError(f"{self.directory} holds the resumable state of another run ({theirs}), not of "
                             f"{self.fingerprint}: remove it or pass another directory")
        with self._manager() as mngr:
            step = mngr.latest_step()
            if step is None:
                return None
            got = mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}),
                rows=ocp.args.JsonRestore()))
        return step, got["state"]["params"], got["state"]["opt_state"], got["rows"]["rows"], got["rows"]["pending"]

    def save(self, step: int, params, opt_state, rows: list[dict], pending: list[dict]) -> None:
        """Save the state after `step` steps, with the rows logged so far and the metrics of the steps since the
        last row (`pending`); blocking: a kill right after it finds the checkpoint whole."""
        import orbax.checkpoint as ocp

        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, FINGERPRINT), "w") as f:
            json.dump(self.fingerprint, f)
        with self._manager() as mngr:
            mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                rows=ocp.args.JsonSave({"rows": rows, "pending": pending})))
            mngr.wait_until_finished()

    def finish(self) -> None:
        """The stage is done: its resumable state goes."""
        shutil.rmtree(self.directory, ignore_errors=True)
