"""Paged KV for one rollout (rollout.kv='paged'): the pool's size from the config, the host page
pool (policy.pages.PagePool) the controller drives and the engine reads its page tables from, and
the pool's fields of summary.json. Host only: no JAX."""

from __future__ import annotations

from collections.abc import Mapping

from flexfloor_jax.policy.pages import PagePool, equal_budget_pages, pages_for


class KVPoolError(ValueError):
  """A pool that cannot hold what the run needs (the message names the config field)."""


def pages_per_worker(r, max_seq_len: int) -> int:
  """rollout.kv_pages, or (0) the pages of the fixed-slot cache's bytes:
  equal_budget_pages(slots_per_worker, max_seq_len, page_size). A pool must hold one sequence
  of max_seq_len tokens (else a lone sequence could not finish). Sliding layers whose window is
  shorter than max_seq_len keep no pages but a ring per sequence row (transformer.KVLayout):
  the pages then hold the fixed-slot cache's full-layer bytes, and the rings are max_seqs rows'
  where the fixed slots have slots_per_worker (the floor counts both: inputs.terms_for_config)."""
  n = r.kv_pages or equal_budget_pages(r.slots_per_worker, max_seq_len, r.page_size)
  need = pages_for(max_seq_len, r.page_size)
  if n < need:
    raise KVPoolError(f"rollout.kv_pages: a pool of {n} pages of {r.page_size} tokens cannot "
                      f"hold one sequence of model.max_seq_len={max_seq_len} tokens "
                      f"({need} pages)")
  return n


def make_pool(r, num_workers: int, max_seq_len: int,
              predicted: Mapping[int, float] | None = None) -> PagePool:
  """A fresh pool for `num_workers` workers: rollout.max_seqs rows each, page tables of
  max_seq_len in pages, admission by `predicted` response lengths with rollout.kv_margin."""
  return PagePool(num_workers, pages_per_worker(r, max_seq_len), r.page_size, r.max_seqs,
                  pages_for(max_seq_len, r.page_size), predicted=predicted, margin=r.kv_margin)


def pool_factory(r, num_workers: int, max_seq_len: int):
  """(predicted lengths) -> a fresh pool: plan.plan_rollout's `kv` (it simulates the flexfloor
  candidates on the pool)."""
  return lambda predicted: make_pool(r, num_workers, max_seq_len, predicted)


def summary(pool: PagePool, kv_pool_bytes: int) -> dict:
  """summary.json's paged-KV fields: the pool's bytes per worker, the most pages any worker held
  at once, the preemptions; and the pool's shape and page counts."""
  st = pool.stats()
  return dict(kv="paged", kv_pool_bytes=int(kv_pool_bytes), kv_peak_pages=st["peak_pages"],
              preemptions=st["preemptions"], kv_pages=st["num_pages"],
              page_size=st["page_size"], max_seqs_per_worker=st["max_seqs"],
              kv_peak_pages_per_worker=st["peak_pages_per_worker"],
              kv_pages_allocated=st["pages_allocated"], kv_pages_freed=st["pages_freed"])
