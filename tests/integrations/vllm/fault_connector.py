"""A test double of kvmove's connector that injects one fault into loads, chosen by the JSON
file ``$KVMOVE_TEST_FAULTS`` (read at every load): ``{"mode": "none" | "zeros" | "remove" |
"wrong_size" | "kill"}``. ``zeros`` writes zeros over the loaded blocks (a wrong connector:
the outputs must change); ``remove`` deletes the last block's object of every load from the
store before the get (a missing object); ``wrong_size`` puts a 16-byte object in place of
the first block's of every load (found by lookups, never loadable); ``kill`` kills the
Mooncake master (pid ``$KVMOVE_TEST_MASTER_PID``) before the get; ``kill_holder:N``
SIGKILLs the N-th store node of ``$KVMOVE_TEST_HOLDER_PIDS`` (comma-separated pids) before
the get. Load errors, and requests whose asynchronous load finished, are appended to
``$KVMOVE_TEST_EVENTS`` as JSON lines."""

from __future__ import annotations

import contextlib
import json
import os
import signal

from kvmove.integrations.vllm import KVMoveConnector


def _mode() -> str:
    with open(os.environ["KVMOVE_TEST_FAULTS"]) as f:
        return json.load(f)["mode"]


def _event(**fields) -> None:
    with open(os.environ["KVMOVE_TEST_EVENTS"], "a") as f:
        f.write(json.dumps(fields) + "\n")


class FaultyKVMoveConnector(KVMoveConnector):
    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if not meta.loads:
            return
        side = self._side
        mode = _mode()
        keys = [side.key_prefix + t.keys[-1] for t in meta.loads]
        if mode == "remove":
            side.store.remove(keys, force=True)
        elif mode == "wrong_size":
            first = [side.key_prefix + t.keys[0] for t in meta.loads]
            side.store.remove(first, force=True)
            for key in first:
                assert side.store.raw_client.put(key, bytes(16)) == 0
        elif mode == "kill":
            os.kill(int(os.environ["KVMOVE_TEST_MASTER_PID"]), signal.SIGKILL)
        elif mode.startswith("kill_holder:"):
            pids = os.environ["KVMOVE_TEST_HOLDER_PIDS"].split(",")
            with contextlib.suppress(ProcessLookupError):  # killed at an earlier load
                os.kill(int(pids[int(mode.partition(":")[2])]), signal.SIGKILL)
        super().start_load_kv(forward_context, **kwargs)
        if mode == "zeros":  # loads whole-cache, not asynchronous: the load has ended here
            assert not side.plan.load_async and not side.plan.layerwise
            ids = [b for t in meta.loads for b in t.block_ids]
            for view in side.views:
                view[ids] = 0
        _event(mode=mode, blocks=sum(len(t.block_ids) for t in meta.loads))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = super().get_block_ids_with_load_errors()
        if errors:
            _event(mode=_mode(), load_errors=len(errors))
        return errors

    def get_finished(self, finished_req_ids):
        sending, recving = super().get_finished(finished_req_ids)
        if recving:
            _event(mode=_mode(), finished_recving=len(recving))
        return sending, recving
