"""Inject one known bug at a time into a copy of the repository and check the tests catch it.

    JAX_PLATFORMS=cpu python scripts/inject_bugs.py            # every bug (a few minutes on 2 cores)
    JAX_PLATFORMS=cpu python scripts/inject_bugs.py "twice"    # those whose name contains a word

Each bug is a one-line edit of the page table's packed array, the prefix cache (device ops, index, scheduler), the host tier
(its ops, its binding to its cache), reserve (its jnp ops, the GPU kernel, the CPU's native call), the native plan and decode attention, the smoothed keys' factors (fixed at create) or a step's
plan (`arena_jax.plan`: its epoch, its watermarks), the TPU attention kernel's steady-state
loop and its 8-bit scale rows, the TPU append's merge of shared scale rows, or the "xla" backend's one-block attention (its V rows' deferred check, decode's select). The tests that
should catch it run in a copy of the tracked files (this checkout is never modified), with the
hypothesis profile "find" (the CI's examples, no shrinking: only "caught or not" matters).
Prints one line per bug and test file; exits 1 if a bug got through.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTANTS = {
    "drop_pages: a hold dropped twice (no held check)": ("arena_jax/prefix/ops.py",
        "    ok = first & (table.held[idx] > 0)\n", "    ok = first\n"),
    "hold_pages: no refcount for the cache's hold": ("arena_jax/prefix/ops.py",
        "        refcount=table.refcount.at[target].add(1, mode=\"drop\"),\n    )\n    stats = cache.stats.bump(pages_held",
        "        refcount=table.refcount,\n    )\n    stats = cache.stats.bump(pages_held"),
    "hold_pages: holds a page with pending writes": ("arena_jax/prefix/ops.py",
        "(table.held[idx] == 0) & ~pending[idx] &", "(table.held[idx] == 0) &"),
    "hold_pages: holds a page twice": ("arena_jax/prefix/ops.py",
        "ok = first & (table.held[idx] == 0) &", "ok = first &"),
    "fork_pages: maps tokens the cache does not hold": ("arena_jax/prefix/ops.py",
        "covered = in_range & (table.held[jnp.clip(pages, 0, num_pages - 1)] >= take)", "covered = in_range & (table.held[jnp.clip(pages, 0, num_pages - 1)] > 0)"),
    "fork_pages: a page used twice in a row": ("arena_jax/prefix/ops.py",
        "& jnp.all(covered | ~use, axis=1) & ~dup", "& jnp.all(covered | ~use, axis=1)"),
    "page_fill: max over layers instead of min": ("arena_jax/prefix/ops.py",
        "settled = jnp.min(table.written, axis=0)[:, None]", "settled = jnp.max(table.written, axis=0)[:, None]"),
    "scheduler: the copied hit page stays counted as indexed": ("models/scheduler/prefix.py",
        "            seq.in_index -= 1\n", ""),
    "scheduler: indexes one token more than was written": ("models/scheduler/admission.py",
        "                self._index(seq, self._page_rows[self.slot_of[r]], seq.fed)\n",
        "                self._index(seq, self._page_rows[self.slot_of[r]], min(seq.fed + 1, len(seq.ids)))\n"),
    "index: a hit does not lock its pages": ("arena_jax/prefix/cache.py",
        "        self._lock(anchor)\n        return anchor", "        return anchor"),
    "index: eviction ignores locks": ("arena_jax/prefix/eviction.py",
        "node.page is not None and not node.locks and not any(", "node.page is not None and not any("),
    "index: lookup ignores the limit (a whole prompt hit)": ("arena_jax/prefix/cache.py",
        "            take = min(best_len, limit - pos)\n", "            take = best_len\n"),
    "index: an unlock without its lock is taken": ("arena_jax/prefix/cache.py",
        "            if node.locks < 1:\n                raise", "            if False:\n                raise"),
    "index: a PAD page is indexed": ("arena_jax/prefix/checks.py",
        "        if p == PAD_PAGE:\n", "        if p == PAD_PAGE and False:\n"),
    "scheduler: a partial hit kept where its copy does not fit": ("models/scheduler/admission.py",
        "hits = [hit, whole] if whole.num_tokens != hit.num_tokens else [hit]", "hits = [hit]"),
    "scheduler: re-admission by the watermark (no room for whole lives)": ("models/scheduler/admission.py",
        "            if seq.preemptions:  # a second admission", "            if False:  # a second admission"),
    # the host tier (arena_jax/host/ops.py, the index's tiers, the scheduler's swaps)
    "swap_out: overwrites a held host page": ("arena_jax/host/ops.py",
        "    free = (host_pages >= 0) & (host_pages < n_host) & (host.held[jnp.clip(host_pages, 0, n_host - 1)] == 0)\n    distinct = _first_uses(host_pages, use, n_host)\n    ok = live",
        "    free = (host_pages >= 0) & (host_pages < n_host)\n    distinct = _first_uses(host_pages, use, n_host)\n    ok = live"),
    "swap_out: the host page table not written": ("arena_jax/host/ops.py",
        "    held = host.held.at[jnp.where(moves, host_pages, n_host)].set(tokens, mode=\"drop\")\n", "    held = host.held\n"),
    "swap_in: takes more tokens than a host page holds": ("arena_jax/host/ops.py",
        "(host.held[jnp.clip(host_pages, 0, n_host - 1)] >= take)", "(host.held[jnp.clip(host_pages, 0, n_host - 1)] > 0)"),
    "swap_in: new pages not counted in refcount": ("arena_jax/host/ops.py",
        "        refcount=table.refcount.at[jnp.where(moves, new_page, num_pages)].set(1, mode=\"drop\"),\n", ""),
    "swap_in: a host page named twice is served": ("arena_jax/host/ops.py",
        "jnp.all((covered & distinct) | ~use, axis=1)", "jnp.all(covered | ~use, axis=1)"),
    "move_pages: one page fewer": ("arena_jax/host/ops.py",
        "    out = {**dst, **(lax.fori_loop(0, count, body, plain) if plain else {})}",
        "    out = {**dst, **(lax.fori_loop(0, jnp.maximum(count - 1, 0), body, plain) if plain else {})}"),
    "offload_pages: keeps the cache's hold": ("arena_jax/host/ops.py",
        "    table, freed = _drop_refs(table.replace(held=table.held.at[target].set(0, mode=\"drop\")), target)\n",
        "    freed = jnp.int32(0)\n"),
    "index: an eviction plan frees a host copy being read (keep ignored)": ("arena_jax/prefix/eviction.py",
        "if not node.live or node.host_page is None or id(node) in keep:", "if not node.live or node.host_page is None:"),
    "index: a returning page does not become the device copy": ("arena_jax/prefix/cache.py",
        "                elif child.page is None and not self._promote(child, page, out):\n                    break\n", ""),
    "scheduler: a swapped-in sequence is fed from its start": ("models/scheduler/admission.py",
        "                seq.fed = seq.swapped_tokens\n", ""),
    "scheduler: a host hit's tail is not brought back": ("models/scheduler/admission.py",
        "                if hit.host_pages:\n                    restore.append(", "                if False:\n                    restore.append("),
    "check_pair: a host tier of another arena accepted (no binding check)": ("arena_jax/host/arena.py",
        "    if mine is not None and theirs is not None and int(mine) != int(theirs):\n", "    if False:\n"),
    "host ops in jit: rows of another arena's host tier served (no arena check)": ("arena_jax/host/ops.py",
        "    return host.arena_id == cache.table.arena_id\n", "    return jnp.bool_(True)\n"),
    # smoothed keys' factors: fixed at create, never by traffic (issue 37)
    "generate: key factors calibrated on the requests (traffic) instead of the model's sample": ("models/generate.py",
        "factors = calibrate_key_factors(model) if layout.smooth_keys else None",
        "factors = calibrate_key_factors(model, tokens=prompts[:1]) if layout.smooth_keys else None"),
    "create: the key factors given are dropped": ("arena_jax/state.py",
        "    return jnp.asarray(factors_lib.check(key_factors, layout.key_factors_shape))\n",
        "    factors_lib.check(key_factors, layout.key_factors_shape)\n    return jnp.zeros(layout.key_factors_shape, jnp.float32)\n"),
    "append: keys divided by factors of the write's own keys, not the cache's": ("arena_jax/arena_ops.py",
        "        k = factors_lib.smooth_keys(k, cache.key_factors[waits_for(layer_c, k)])\n",
        "        k = factors_lib.smooth_keys(k, factors_lib.from_keys(k[None])[0])\n"),
    # step plans: every layer's bookkeeping once a step (issue 39, item 2)
    "plan: a plan of another epoch still used": ("arena_jax/plan.py",
        " & (table.epoch == self.epoch)", ""),
    "plan: attention reads the watermark before the layer's append": ("arena_jax/plan.py",
        "    after = written + jnp.take(append.accepted, first, axis=1)\n", "    after = written\n"),
    "plan: a layer's plan entry no longer waits for its data (the loop widens past XLA's 8)": ("arena_jax/arena_ops.py",
        "    if x is None or x.size == 0 or target_platform() != \"cpu\":\n", "    if True:\n"),
    "plan: the entry a layer waits for is off by its data's sign bit": ("arena_jax/arena_ops.py",
        "jnp.clip(jax.lax.bitcast_convert_type(first, as_int), 0, 0)",
        "jnp.clip(jax.lax.bitcast_convert_type(first, as_int), -1, 0)"),
    "api: a constant layer folded into every layer's kernels again (each compiled apart)": ("arena_jax/api.py",
        "    if not isinstance(given, jax.core.Tracer) and isinstance(cache.k, jax.core.Tracer):\n", "    if False:\n"),
    "api: the barrier put on the layer scan's counter too (the loop widens)": ("arena_jax/api.py",
        "    if not isinstance(given, jax.core.Tracer) and isinstance(cache.k, jax.core.Tracer):\n",
        "    if isinstance(cache.k, jax.core.Tracer):\n"),
    "release: the epoch kept (a stale plan writes the freed pages)": ("arena_jax/allocator.py",
        "    return cache.replace(table=cache.table.advanced(changed),", "    return cache.replace(table=cache.table,"),
    # the page table packed in one array (arena_jax/kv_cache.py; issue 39)
    "page table: a row out of range written into the next region": ("arena_jax/kv_cache.py",
        "return jnp.where((rows >= 0) & (rows < num_rows), start + rows * width + cols, self.packed.shape[0])",
        "return start + rows * width + cols"),
    "plan: a deferred plan of another epoch commits its watermarks": ("arena_jax/plan.py",
        "        moves = usable & (accepted >= 0)\n", "        moves = accepted >= 0\n"),
    "page table: a layer's watermark written into the previous layer's column": ("arena_jax/kv_cache.py",
        "            cols.append(2 + layer)\n", "            cols.append(1 + layer)\n"),
    "page table: replace keeps the old value of a field it is given": ("arena_jax/kv_cache.py",
        "values = [changes[f] if f in changes else getattr(out, f) for f in group]",
        "values = [getattr(out, f) for f in group]"),
    "reserve: the allocator's refcounts land in the held row": ("arena_jax/allocator.py",
        "page_words=table.page_words.at[1, ref_pages]", "page_words=table.page_words.at[2, ref_pages]"),
    "reserve: the allocator pops pages without taking them off the free count": ("arena_jax/allocator.py",
        "words=table.words.at[0].add(-jnp.sum(granted))", "words=table.words.at[0].add(0 * jnp.sum(granted))"),
    "release: freed pages not pushed on the free stack": ("arena_jax/allocator.py",
        "jnp.where(freed, 0, 3), jnp.where(freed, slot_in_stack, 0)", "jnp.where(freed, 3, 3), jnp.where(freed, slot_in_stack, 0)"),
    "fork: the shared pages' refcounts left as they were": ("arena_jax/allocator.py",
        "jnp.where(shared, 1, 3)", "jnp.where(shared, 3, 3)"),
    "truncate: the layers' watermarks not cut to the new length": ("arena_jax/allocator.py",
        "jnp.minimum(words[:, 2:], new_length[:, None])", "words[:, 2:]"),
    # reserve's table work as one GPU kernel (pallas_kernels/gpu/allocate.py; issue 39, item 4)
    "reserve kernel: a keeper served though its co-holder's copy was refused": ("pallas_kernels/gpu/allocate.py",
        "    ok &= ~(wants_cow & keeper & (count(same & refused[None, :]) > 0))\n", "\n"),
    "reserve kernel: a row's new pages past the first loop trip not mapped": ("pallas_kernels/gpu/allocate.py",
        "(highest + page_lanes - 1) // page_lanes, new_pages, 0)", "highest // page_lanes, new_pages, 0)"),
    "reserve kernel: a slot named twice served twice": ("pallas_kernels/gpu/allocate.py",
        "live = first_named & (asked >= 0)", "live = in_range & (asked >= 0)"),
    "reserve kernel: copy-on-write copies the first layer's page only": ("pallas_kernels/gpu/allocate.py",
        "lax.fori_loop(0, num_layers * num_heads, one_page, carry)", "lax.fori_loop(0, num_heads, one_page, carry)"),
    # reserve's table work as one native call on a CPU (pallas_kernels/cpu/allocate.cc; rebuilt by its hash)
    "native reserve: a keeper served though its co-holder's copy was refused": ("pallas_kernels/cpu/allocate.cc",
        "    ok[b] = ok[b] && !(wants_cow[b] && keeper[b] && holder_refused);\n", "\n"),
    "native reserve: a slot named twice served twice": ("pallas_kernels/cpu/allocate.cc",
        "const bool first_named = in_range && !named_before;", "const bool first_named = in_range;"),
    "native reserve: copy-on-write copies the first layer's page only": ("pallas_kernels/cpu/allocate.cc",
        "lh < pages_per_arena / P; lh++", "lh < pages_per_arena / P / g.num_layers; lh++"),
    "native reserve: rows refused for want of pages not counted": ("pallas_kernels/cpu/allocate.cc",
        "events[3] += live[b] && !ok[b];", "events[3] += 0;"),
    # a step's plan as one native call on a CPU (pallas_kernels/cpu/plan.cc)
    "native plan: a shared page taken as private": ("pallas_kernels/cpu/plan.cc",
        "writable = page >= 0 && at(refcount_at + clip(page, 0, P - 1)) == 1;", "writable = page >= 0;"),
    "native plan: attention reads the watermark before the layer's append": ("pallas_kernels/cpu/plan.cc",
        "const int32_t after = add32(written[b], accepted[std::min(first[b], B - 1)]);", "const int32_t after = written[b];"),
    "native plan: tokens written counted at every layer": ("pallas_kernels/cpu/plan.cc",
        "sums[0] += (layer_ok && l == 0) ?", "sums[0] += layer_ok ?"),
    "native plan: a row written past its slot's reservation": ("pallas_kernels/cpu/plan.cc",
        "const bool fits = at(words + 1) != 0 && nn <= sub32(reserved, start);", "const bool fits = at(words + 1) != 0;"),
    "native plan commit: a row that writes nothing sets its slot's watermark": ("pallas_kernels/cpu/plan.cc",
        "if (r4[1] >= 0 && slots[b] >= 0 && slots[b] < S)", "if (slots[b] >= 0 && slots[b] < S)"),
    "native plan commit: the out-of-range layer's counters added": ("pallas_kernels/cpu/plan.cc",
        "for (int64_t l = 0; l < L; l++) sum +=", "for (int64_t l = 0; l <= L; l++) sum +="),
    # decode attention as one native call a layer on a CPU (pallas_kernels/cpu/attention.cc)
    "native attention: the window admits one key too many": ("pallas_kernels/cpu/attention.cc",
        "int64_t lo = windowed ? std::max<int64_t>(0, pos - window + 1) : 0;",
        "int64_t lo = windowed ? std::max<int64_t>(0, pos - window) : 0;"),
    "native attention: an unmapped page read as page 0": ("pallas_kernels/cpu/attention.cc",
        "if (page >= 0) keys.push_back((std::min<int64_t>(page, P - 1)", "keys.push_back((std::clamp<int64_t>(page, 0, P - 1)"),
    "native attention: a poisoned score skipped, not NaN": ("pallas_kernels/cpu/attention.cc",
        "            poisoned[g] = 1;\n            continue;", "            continue;"),
    "native attention: a V row's overflow or poison left finite": ("pallas_kernels/cpu/attention.cc",
        "bad = !std::isfinite(acc[g * D + d]);", "bad = false;"),
    "native attention: the soft cap not applied": ("pallas_kernels/cpu/attention.cc",
        "          if (soft_cap > 0) s = std::tanh(s / soft_cap) * soft_cap;\n", ""),
    "native attention: the layer operand ready as the scan's iteration starts": ("arena_jax/arena_ops.py",
        "decode_attention_rows(q, cache.k, cache.v, waits_for(layer, q), plan.rows,",
        "decode_attention_rows(q, cache.k, cache.v, layer, plan.rows,"),
    "native attention: a traced window ready as the scan's iteration starts": ("arena_jax/arena_ops.py",
        "            sliding_window = waits_for(sliding_window, q)\n", "            pass\n"),
    # the TPU attention kernel's steady-state loop (issue 42)
    "tpu attention: the fast loop starts this block again, not the next one": (
        "pallas_kernels/tpu/attention.py", "start_whole(j_next, 1 - slot, run_next)", "start_whole(j, 1 - slot, run_next)"),
    "tpu attention: the fast loop takes a block with a hole": ("pallas_kernels/tpu/attention.py",
        "fast_lo = jnp.maximum(fast_lo, lax.div(hole_end + block_k - 1, block_k))", "fast_lo = fast_lo"),
    "tpu attention: the general step misses a hole in the block that ends at the row's last hole": (
        "pallas_kernels/tpu/attention.py", "jnp.where(j * block_k < hole_end, p1, p0)",
        "jnp.where(j * block_k + block_k < hole_end, p1, p0)"),
    "tpu attention: the fast loop's second pair is not checked": ("pallas_kernels/tpu/attention.py",
        "return in_fast(j) & in_fast(j + 1) & (i + 2 < total)", "return in_fast(j) & (i + 2 < total)"),
    "tpu attention: a fast prefill block misses a non-finite V row": ("pallas_kernels/tpu/attention.py",
        "bad_blk = jnp.maximum(bad_s, jnp.max(jnp.where(v_ok_col, 0.0, 1.0)))", "bad_blk = bad_s"),
    "tpu attention: the fast loop takes a block the first query cannot see whole": ("pallas_kernels/tpu/attention.py",
        "lax.div(jnp.maximum(start + t_first + 1, 0), block_k)", "lax.div(jnp.maximum(start + t_first + 1 + block_k, 0), block_k)"),
    "tpu attention: scale rows rotated the wrong way": ("pallas_kernels/tpu/attention.py",
        "pltpu.roll(out, (1 << bit) * page_size, 1)", "pltpu.roll(out, 128 - (1 << bit) * page_size, 1)"),
    "tpu attention: scale rows' shifts without the page's place in its block": ("pallas_kernels/tpu/attention.py",
        "% pages_per_block  # the page's place in its block", "  # the page's place in its block"),
    "tpu append: each entry moves its own copy of a shared scale row": ("pallas_kernels/tpu/append.py",
        "moved_rows = flat(slive) & (owner == arange(sentries))",
        "moved_rows = flat(slive); owner = arange(sentries)"),
    # the "xla" backend's one-block attention (pallas_kernels/blockwise.py)
    "blockwise: one block keeps a poisoned V row's output without the check": ("pallas_kernels/blockwise.py",
        "return jnp.where(bad, jnp.nan, l), jnp.where(bad[..., None], jnp.nan, values_v(p))", "return l, values_v(p)"),
    "blockwise: one block never checks its V rows": ("pallas_kernels/blockwise.py",
        "l, acc = lax.cond(jnp.all(jnp.isfinite(acc)), lambda: (l, acc), checked)", "pass"),
    "blockwise: decode leaves a poisoned head's finite lanes": ("pallas_kernels/blockwise.py",
        "return jnp.where(bad, jnp.nan, l), jnp.where(bad[..., None], jnp.nan, acc)", "return l, acc"),
    "blockwise: decode reads the keys past its query": ("pallas_kernels/blockwise.py",
        "mask = key_live[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None]) & q_ok",
        "mask = key_live[:, None, :] & q_ok"),
}
TESTS = {
    "arena_jax/prefix/ops.py": ["tests/test_allocator_model.py", "tests/test_prefix.py"],
    "models/scheduler/admission.py": ["tests/test_prefix.py", "tests/test_prefix_progress.py", "tests/test_host_tier.py"],
    "models/scheduler/prefix.py": ["tests/test_prefix.py", "tests/test_prefix_progress.py", "tests/test_host_tier.py"],
    "arena_jax/prefix/cache.py": ["tests/test_prefix.py", "tests/test_prefix_index.py", "tests/test_host_tier.py"],
    "arena_jax/prefix/eviction.py": ["tests/test_prefix_index.py", "tests/test_host_tier.py"],
    "arena_jax/prefix/checks.py": ["tests/test_prefix.py", "tests/test_prefix_index.py"],
    "arena_jax/host/ops.py": ["tests/test_allocator_model.py", "tests/test_host_tier.py"],
    "arena_jax/host/arena.py": ["tests/test_host_tier.py"],
    "models/generate.py": ["tests/test_schedule_invariance.py"],
    "arena_jax/state.py": ["tests/test_key_factors.py"],
    "arena_jax/arena_ops.py": ["tests/test_key_factors.py", "tests/test_allocator_model.py", "tests/test_plan.py",
                               "tests/test_op_hlo.py", "tests/test_attention_native.py"],
    "arena_jax/plan.py": ["tests/test_plan.py", "tests/test_op_hlo.py", "tests/test_plan_native.py"],
    "arena_jax/api.py": ["tests/test_op_hlo.py"],
    "arena_jax/kv_cache.py": ["tests/test_allocator.py", "tests/test_allocator_model.py"],
    "arena_jax/allocator.py": ["tests/test_plan.py", "tests/test_allocator_model.py", "tests/test_allocator.py",
                               "tests/test_kernels_allocate.py"],  # (reserve's jnp ops against the kernels)
    "pallas_kernels/tpu/attention.py": ["tests/test_kernels_tpu.py"],
    "pallas_kernels/tpu/append.py": ["tests/test_kernels_tpu.py"],
    "pallas_kernels/blockwise.py": ["tests/test_blockwise.py"],
    "pallas_kernels/gpu/allocate.py": ["tests/test_kernels_allocate.py"],
    "pallas_kernels/cpu/allocate.cc": ["tests/test_kernels_allocate.py"],
    "pallas_kernels/cpu/plan.cc": ["tests/test_plan_native.py"],
    "pallas_kernels/cpu/attention.cc": ["tests/test_attention_native.py"],
}


def main(argv) -> int:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in files:
            os.makedirs(os.path.join(tmp, os.path.dirname(f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(tmp, f))
        env = dict(os.environ, PYTHONPATH=tmp, HYPOTHESIS_PROFILE="find", ARENA_JAX_NATIVE_DIR=os.path.join(tmp, ".native"))
        where = subprocess.run([sys.executable, "-c", "import arena_jax, models; print(arena_jax.__file__, models.__file__)"],
                               cwd=tmp, env=env, capture_output=True, text=True).stdout  # fmt: skip
        if where.count(tmp) != 2:  # else a "caught" could be another checkout's import error
            print(f"the copy's packages are not the ones imported ({where.strip()}): stopping")
            return 2
        for name, (path, old, new) in MUTANTS.items():
            if argv and not any(word in name for word in argv):
                continue
            target = os.path.join(tmp, path)
            original = open(target).read()
            if original.count(old) != 1:
                print(f"{name}: the line to change is not in {path} (the code moved): update this script")
                missed += 1
                continue
            open(target, "w").write(original.replace(old, new))
            try:
                caught = False
                for test in TESTS[path]:
                    t0 = time.time()
                    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
                                         cwd=tmp, env=env, capture_output=True, text=True)  # fmt: skip
                    failed = next((line for line in run.stdout.splitlines() if line.startswith("FAILED")), "")
                    caught = run.returncode != 0
                    print(f"{name} | {test}: {'caught' if caught else 'missed'} ({time.time() - t0:.0f} s) {failed[:140]}", flush=True)
                    if caught:
                        break
                missed += not caught
            finally:
                open(target, "w").write(original)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
