"""One rank of a tensor-parallel run, launched by tests/test_tp.py under `mpirun -n N`.

    python tests/tp_worker.py SPEC.json OUT_DIR

SPEC: {"timeout_s": s, "jobs": [{"checkpoint", "drafter": "sharded" | "replicated" | "none", "prompts",
"params": [SamplingParams kwargs per prompt], "block_size", "oracle": reference outputs (optional: OracleDrafts),
"die_after_steps": n (optional: rank 1 dies before its n-th verify)}]}.
Each rank writes OUT_DIR/rank{r}.json: per job its outputs, accepted lengths, the drafter's own drafts per
draft call (what it proposed, even when OracleDrafts replaced them) and, per verify / draft call, the
collectives it made. Errors print `error: ...` and exit 2, as the CLI does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from dflash_trt.errors import DFlashError
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.loading import load_tp_backend
from dflash_trt.tp import init_tp

torch.set_num_threads(1)


class RecordedDrafts:
    """Forwards to the backend and keeps what its drafter proposed in every draft call (`drafts`)."""

    def __init__(self, inner):
        self.inner = inner
        self.drafts: list[list[list[int]]] = []  # per draft call, per sequence

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, seq_ids, last_tokens, num_drafts):
        self.drafts.append(self.inner.draft(seq_ids, last_tokens, num_drafts))
        return self.drafts[-1]


class OracleDrafts:
    """Proposes the reference continuation `refs`, right for a varying number of tokens and then wrong, so
    steps accept long blocks (a random drafter accepts nothing); the real drafter still runs first (wrap it
    in RecordedDrafts to check its drafts). The pattern depends only on the sequence and its progress:
    TP=1 and every rank propose the same drafts."""

    def __init__(self, inner, prompts: list[list[int]], refs: list[list[int]]):
        self.inner, self.prompts, self.refs = inner, prompts, refs

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, seq_ids, last_tokens, num_drafts):
        self.inner.draft(seq_ids, last_tokens, num_drafts)
        out = []
        for s, k in zip(seq_ids, num_drafts):
            done = self.inner.target_cache.lengths[s] - len(self.prompts[s]) + 1  # tokens committed so far
            truth = (self.refs[s] + [0] * 64)[done : done + k]
            right = (3 * done + s) % (k + 1)
            out.append(truth[:right] + [(t + 1) % self.inner.vocab_size for t in truth[right:]])
        return out


class CountingBackend:
    """Forwards to the TP backend and records the collectives of each verify and draft call."""

    def __init__(self, inner, tp, die_after_steps: int | None):
        self.inner, self.tp, self.die_after_steps = inner, tp, die_after_steps
        self.records: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _recorded(self, op: str, shape: list[int], fn):
        calls, nbytes = dict(self.tp.calls), dict(self.tp.bytes)
        out = fn()
        self.records.append({
            "op": op, "shape": shape,
            "calls": {k: v - calls.get(k, 0) for k, v in self.tp.calls.items() if v - calls.get(k, 0)},
            "bytes": {k: v - nbytes.get(k, 0) for k, v in self.tp.bytes.items() if v - nbytes.get(k, 0)},
        })
        return out

    def draft(self, seq_ids, last_tokens, num_drafts):
        return self._recorded("draft", list(num_drafts), lambda: self.inner.draft(seq_ids, last_tokens, num_drafts))

    def verify(self, seq_ids, blocks, need_logits=None):
        steps = sum(r["op"] == "verify" for r in self.records)
        if self.die_after_steps is not None and steps == self.die_after_steps and self.tp.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a rank dying mid-run, between two collectives
        return self._recorded("verify", [len(b) for b in blocks], lambda: self.inner.verify(seq_ids, blocks, need_logits))


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    tp = init_tp("cpu", timeout_s=spec.get("timeout_s", 60))
    try:
        results = []
        for job in spec["jobs"]:
            mode = job.get("drafter", "sharded")
            backend = load_tp_backend(job["checkpoint"], tp, use_drafter=mode != "none", drafter_mode="sharded" if mode == "none" else mode,
                                      num_pages=256, page_size=4, block_size=job.get("block_size"))
            backend = recorded = RecordedDrafts(backend)
            if job.get("oracle"):
                backend = OracleDrafts(backend, job["prompts"], job["oracle"])
            counting = CountingBackend(backend, tp, job.get("die_after_steps"))
            params = [SamplingParams(**p) for p in job["params"]]
            outs = Generator(counting, max_batch=len(job["prompts"])).generate(job["prompts"], params)
            results.append({"outputs": [o.output_ids for o in outs], "accepted": [o.accepted_lengths for o in outs],
                            "drafts": recorded.drafts, "records": counting.records})
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        tp.close()
    (out / f"rank{tp.rank}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
