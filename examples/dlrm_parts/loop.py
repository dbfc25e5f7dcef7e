"""The training loop every run shares: batches from the click log on the model's device, a
tqdm bar (samples/s, running loss), evaluation points (AUC and logloss on the held-out set),
and the figures of the final table. Evaluation time is not counted in samples/s.

Batches are made ahead, :data:`CHUNK_STEPS` at a time (:class:`Feed`): one set of kernels
makes the batches of 32 steps, so data costs the step a slice of ~150 launches' host time (3 ms
a chunk: what a host-bound JAX step would otherwise pay every few steps); chunks start at
multiples of 32 steps, so a resumed run sees exactly the bits an uninterrupted one sees. On a
GPU the next chunk is made on a stream of its own while the current chunk's steps train, so
making data overlaps training instead of adding to it."""

from __future__ import annotations

import time

import numpy as np

from .metrics import auc, logloss


class EvalSet:
    """The held-out batches, generated once on the device and kept in each framework's
    format; labels and the hidden model's logits on the host for the metrics."""

    CHUNK = 8192  # evaluation batch: the set does not depend on the training batch size

    def __init__(self, log, samples, xp):
        chunk = min(self.CHUNK, max(int(samples), 1))
        self.batches = [log.eval_batch(i, chunk, xp) for i in range(max(1, samples // chunk))]
        host = (lambda a: a.get()) if xp is not np else np.asarray
        self.labels = np.concatenate([host(b.label) for b in self.batches]).astype(np.float64)
        self.oracle_logits = np.concatenate([host(b.logit) for b in self.batches])
        self.oracle_auc = auc(self.labels, self.oracle_logits)
        self.oracle_logloss = logloss(self.labels, self.oracle_logits)
        self._converted = {}

    def evaluate(self, run, key):
        if key not in self._converted:  # a run may convert held-out chunks its own way
            convert = getattr(run, "eval_to_framework", run.to_framework)
            self._converted[key] = [convert(b) for b in self.batches]
        from xferlib import to_numpy

        logits = [run.predict(data) for data in self._converted[key]]
        run.sync()
        scores = np.concatenate([np.asarray(to_numpy(_host(s))) for s in logits])
        return auc(self.labels, scores), logloss(self.labels, scores)


def _host(x):
    kind = type(x).__module__
    if kind.startswith("torch"):
        return x.detach().cpu()
    if kind.startswith("jax"):
        return np.asarray(x)
    return x


def _mean(losses) -> float:
    """The mean of the steps' losses, stacked where they live and read back once (a read
    per loss would wait and copy 50 times)."""
    kind = type(losses[0]).__module__
    if kind.startswith("torch"):
        import torch

        return float(torch.stack(losses).double().mean())
    if kind.startswith("jax"):
        import jax

        # every copy started before the first wait, and nothing to compile
        return float(np.mean(np.asarray(jax.device_get(losses)), dtype=np.float64))
    return float(np.mean([float(_host(v)) for v in losses]))


CHUNK_STEPS = 32
AHEAD = True  # on a GPU, make the next chunk on a side stream (False: on the step's stream)


class Feed:
    """Training batch ``step`` in the run's format, from chunks of :data:`CHUNK_STEPS` steps
    made on the model's device (``xp``) before they are needed.

    On a GPU (``xp`` is CuPy) with ``ahead``, each chunk is made one chunk early on a
    non-blocking stream of its own and the steps' stream waits on an event for it (no host
    synchronization), so the generating kernels run beside the training kernels. The side
    stream first waits for every step queued so far: a chunk's memory, allocated on the
    side stream, goes back to it when the chunk is dropped, and is reused only after the
    steps that read it have run. The bits of every batch are the same either way."""

    def __init__(self, run, log, batch_size, xp, ahead=None):
        self.run, self.log, self.batch_size, self.xp = run, log, batch_size, xp
        self._chunk, self._first, self._steps = None, None, None
        gpu = getattr(xp, "__name__", "") == "cupy"
        self._side = (xp.cuda.Stream(non_blocking=True)
                      if gpu and (AHEAD if ahead is None else ahead) else None)
        self._next = None  # (first step, chunk, its ready event), made on the side stream

    def _make(self, first: int):
        # under torchrun with a sharded collection: this rank's samples only
        return self.log.batches(first, CHUNK_STEPS, self.batch_size, self.xp,
                                part=getattr(self.run, "part", None))

    def _ahead(self, first: int):
        cuda = self.xp.cuda
        queued = cuda.Event(disable_timing=True)
        queued.record()  # on the steps' stream: every step queued so far
        self._side.wait_event(queued)
        with self._side:
            chunk = self._make(first)
        ready = cuda.Event(disable_timing=True)
        ready.record(self._side)
        return first, chunk, ready

    def _chunk_at(self, first: int):
        if self._side is None:
            return self._make(first)
        ahead = self._next if self._next is not None and self._next[0] == first else None
        _, chunk, ready = ahead or self._ahead(first)  # a jump (resume, profile): made now
        self.xp.cuda.get_current_stream().wait_event(ready)
        self._next = self._ahead(first + CHUNK_STEPS)
        return chunk

    def __call__(self, step: int):
        first = step - step % CHUNK_STEPS
        if first != self._first:
            self._chunk = self._chunk_at(first)
            self._first = first
            # a run that converts a whole chunk at once (JAX: one conversion and one split
            # per chunk instead of a conversion per step) gives its steps' batches here
            split = getattr(self.run, "chunk_steps", None)
            self._steps = split(self._chunk) if split is not None else None
        i = step - first
        if self._steps is not None:
            return self._steps[i]
        c = self._chunk
        return self.run.to_framework(type(c)(c.dense[i], c.cat[i], c.label[i], c.logit[i]))


def train(run, log, eval_set, *, name, start_step, steps, batch_size, xp, evals, history,
          progress=True):
    """Run ``steps`` steps from ``start_step``; evaluate at the end and at ``evals`` points
    spread over the run; append to ``history``. Returns ``(seconds, timed steps)``: training
    time without evaluations and without the run's warm-up steps (``run.warmup_steps()``,
    default 1: compilation; a CUDA-graph run's eager warm-up steps and its capture)."""
    from tqdm import tqdm

    stop = start_step + steps
    points = set(int(round(start_step + steps * (k + 1) / max(evals, 1)))
                 for k in range(max(evals, 1)))
    # The first steps compile and warm up (a graph-captured run: its eager warm-up steps and
    # the capture): left out of samples/s, the same rule for every engine.
    untimed = min(max(1, int(getattr(run, "warmup_steps", lambda: 1)())), steps - 1)

    def timed(done):  # steps inside the timed window
        return max(done - start_step - untimed, 1)

    bar = tqdm(total=steps, desc=name, unit="step", disable=not progress, leave=True,
               dynamic_ncols=True, mininterval=0.5)
    feed = Feed(run, log, batch_size, xp)
    train_time, running, t0, losses = 0.0, None, time.perf_counter(), []
    for step in range(start_step, stop):
        losses.append(run.step(feed(step)))
        bar.update(1)
        done = step + 1
        if untimed > 0 and done == start_step + untimed:  # the warm-up is over: untimed
            run.sync()
            t0 = time.perf_counter()
        if done in points or len(losses) >= 50:
            value = _mean(losses)  # one sync and one copy per 50 steps
            running = value if running is None else 0.8 * running + 0.2 * value
            losses = []
            elapsed = train_time + time.perf_counter() - t0
            bar.set_postfix(loss=f"{running:.4f}",
                            samples_s=f"{timed(done) * batch_size / elapsed:,.0f}")
        if done in points:
            run.sync()
            train_time += time.perf_counter() - t0
            a, ll = eval_set.evaluate(run, name)
            history.append({"step": done, "samples": done * batch_size, "auc": a,
                            "logloss": ll, "train_loss": running})
            bar.set_postfix(loss=f"{running:.4f}", auc=f"{a:.4f}",
                            samples_s=f"{timed(done) * batch_size / train_time:,.0f}")
            t0 = time.perf_counter()
    bar.close()
    return train_time, timed(stop)
