// A forward pass's plan (`arena_jax.plan._plan`) as one XLA FFI call on a CPU: every layer's
// append and attention rows from the packed page table, with the jnp ops' rules and int32
// arithmetic (their reference: `arena_jax.plan._plan` with `native=False`; tests/test_plan_native.py
// compares them on random tables). Built with allocate.cc by `pallas_kernels/cpu/_build.py`.
// Every read is clipped into its region.
#include <vector>

#include "table.h"

namespace {

using namespace arena_native;
// int32 arithmetic as XLA's: wrapping adds, unsigned division of non-negative values.
int32_t add32(int32_t a, int32_t b) { return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b)); }
int32_t sub32(int32_t a, int32_t b) { return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b)); }
int32_t mul32(int32_t a, int32_t b) { return static_cast<int32_t>(static_cast<uint32_t>(a) * static_cast<uint32_t>(b)); }
int32_t udiv32(int32_t a, int32_t b) { return static_cast<int32_t>(static_cast<uint32_t>(a) / static_cast<uint32_t>(b)); }
int32_t urem32(int32_t a, int32_t b) { return static_cast<int32_t>(static_cast<uint32_t>(a) % static_cast<uint32_t>(b)); }

ffi::Error PlanImpl(I32 slots_buf, I32 num_tokens_buf,
                    I32 packed_buf, I32Out rows_out,
                    I32Out tokens_out, I32Out rows4_out,
                    I32Out counts_out, I32Out epoch_out,
                    int64_t max_seqs, int64_t max_pages, int64_t num_layers, int64_t num_pages, int64_t page_size,
                    int64_t page_map_at, int64_t slot_words_at, int64_t page_words_at, int64_t words_at,
                    int64_t pad_slot, int64_t width, ffi::Span<const int64_t> counters) {
  const int64_t S = max_seqs, M = max_pages, L = num_layers, P = num_pages, ps = page_size, T = width;
  const int64_t B = slots_buf.element_count(), W = packed_buf.element_count();
  const int64_t N = counts_out->element_count() / (L + 1), refcount_at = page_words_at + P;
  if (S <= 0 || M <= 0 || L <= 0 || P <= 0 || ps <= 0 || T <= 0 || counters.size() != 3 ||
      static_cast<int64_t>(num_tokens_buf.element_count()) != B || refcount_at + P > W || words_at + 3 > W ||
      page_map_at + S * M > W || slot_words_at + S * (2 + L) > W ||
      static_cast<int64_t>(rows_out->element_count()) != B * M ||
      static_cast<int64_t>(tokens_out->element_count()) != (L + 1) * B * T ||
      static_cast<int64_t>(rows4_out->element_count()) != (L + 1) * B * 4)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "plan_rows: the geometry and shapes do not fit");
  for (int64_t c : counters)
    if (c < 0 || c >= N) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "plan_rows: a counter outside counts");
  const int32_t* slots = slots_buf.typed_data();
  const int32_t* num_tokens = num_tokens_buf.typed_data();
  const int32_t* packed = packed_buf.typed_data();
  int32_t* rows = rows_out->typed_data();
  int32_t* tokens = tokens_out->typed_data();
  int32_t* rows4 = rows4_out->typed_data();
  int32_t* counts = counts_out->typed_data();
  auto at = [&](int64_t i) { return packed[clip(i, 0, W - 1)]; };
  const int32_t none = static_cast<int32_t>(P * ps), limit = static_cast<int32_t>(M * ps);
  // The rows: slot in range, its gather index, the first row naming it, its page-table row.
  std::vector<char> in_range(B), live(B);
  std::vector<int64_t> idx(B), first(B);
  for (int64_t b = 0; b < B; b++) {
    in_range[b] = slots[b] >= 0 && slots[b] < S;
    idx[b] = in_range[b] ? slots[b] : 0;
    first[b] = B;
    for (int64_t j = 0; j < B && in_range[b]; j++)
      if (slots[j] == slots[b]) {
        first[b] = j;
        break;
      }
    live[b] = in_range[b] && first[b] == b;
    for (int64_t m = 0; m < M; m++) rows[b * M + m] = at(page_map_at + idx[b] * M + m);
  }
  std::vector<int32_t> accepted(B), written(B);
  std::vector<uint32_t> sums(3);
  for (int64_t l = 0; l <= L; l++) {
    const bool layer_ok = l < L;
    sums.assign(3, 0);
    for (int64_t b = 0; b < B; b++) {  // `arena_ops.append_rows` at layer l
      const int64_t words = slot_words_at + idx[b] * (2 + L);
      written[b] = layer_ok ? at(words + 2 + l) : 0;
      const int32_t n = num_tokens[b];
      const bool good = live[b] && layer_ok && n >= 0 && n <= T;
      const int32_t nn = good ? n : 0, start = good ? written[b] : 0, reserved = good ? at(words) : 0;
      const bool fits = at(words + 1) != 0 && nn <= sub32(reserved, start);
      bool writable = good && fits;
      for (int64_t t = 0; t < nn && writable; t++) {
        const int32_t pos = add32(start, static_cast<int32_t>(t));
        const int32_t page = rows[b * M + clip(std::min<int64_t>(udiv32(pos, ps), M - 1), 0, M - 1)];
        writable = page >= 0 && at(refcount_at + clip(page, 0, P - 1)) == 1;
      }
      accepted[b] = writable ? nn : 0;
      for (int64_t t = 0; t < T; t++) {
        const int32_t pos = add32(start, static_cast<int32_t>(t));
        const int32_t page = rows[b * M + clip(std::min<int64_t>(udiv32(pos, ps), M - 1), 0, M - 1)];
        const bool ok = writable && t < nn && page >= 0 && pos < limit;
        tokens[(l * B + b) * T + t] = ok ? add32(mul32(page, ps), urem32(pos, ps)) : none;
      }
      int32_t* r4 = rows4 + (l * B + b) * 4;
      r4[0] = add32(start, accepted[b]);
      r4[1] = writable ? accepted[b] : -1;
      sums[0] += (layer_ok && l == 0) ? static_cast<uint32_t>(accepted[b]) : 0;  // tokens_written: layer 0's
      sums[1] += good && nn > 0 && !writable;  // dropped_writes
      sums[2] += slots[b] != pad_slot && !good;  // rejected_rows
    }
    for (int64_t b = 0; b < B; b++) {  // `arena_ops.attend_rows` after the layer's append
      const int32_t after = add32(written[b], accepted[std::min(first[b], B - 1)]);
      const int32_t w = in_range[b] && layer_ok ? after : 0, n = num_tokens[b];
      const bool good = in_range[b] && layer_ok && n >= 0 && n <= T && n <= w;
      rows4[(l * B + b) * 4 + 2] = good ? w : 0;
      rows4[(l * B + b) * 4 + 3] = good ? n : -1;
    }
    for (int64_t i = 0; i < N; i++) counts[l * N + i] = 0;
    for (int i = 0; i < 3; i++) counts[l * N + counters[i]] = static_cast<int32_t>(sums[i]);
  }
  epoch_out->typed_data()[0] = at(words_at + 1);
  return ffi::Error::Success();
}

// The plan, then what `StepPlan.commit(cache)` makes of it for a deferred plan whose layers each
// append once, over the table and counters the plan was made from (the table's epoch is the
// plan's): the packed table with every layer's watermark where its append leaves it (a row that
// writes nothing, rows4[l, b, 1] < 0, leaves its slot's), and the counters plus every layer's.
ffi::Error PlanCommitImpl(I32 slots_buf, I32 num_tokens_buf, I32 packed_buf, I32 stats_buf,
                          I32Out rows_out, I32Out tokens_out, I32Out rows4_out, I32Out counts_out,
                          I32Out epoch_out, I32Out packed_out, I32Out stats_out,
                          int64_t max_seqs, int64_t max_pages, int64_t num_layers, int64_t num_pages,
                          int64_t page_size, int64_t page_map_at, int64_t slot_words_at, int64_t page_words_at,
                          int64_t words_at, int64_t pad_slot, int64_t width, ffi::Span<const int64_t> counters) {
  const int64_t L = num_layers, S = max_seqs, B = slots_buf.element_count(), W = packed_buf.element_count();
  const int64_t N = stats_buf.element_count();
  if (static_cast<int64_t>(packed_out->element_count()) != W || static_cast<int64_t>(stats_out->element_count()) != N ||
      static_cast<int64_t>(counts_out->element_count()) != (L + 1) * N)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "plan_rows: the committed table or counters do not fit");
  ffi::Error error = PlanImpl(slots_buf, num_tokens_buf, packed_buf, rows_out, tokens_out, rows4_out, counts_out,
                              epoch_out, max_seqs, max_pages, num_layers, num_pages, page_size, page_map_at,
                              slot_words_at, page_words_at, words_at, pad_slot, width, counters);
  if (error.failure()) return error;
  const int32_t* slots = slots_buf.typed_data();
  const int32_t* rows4 = rows4_out->typed_data();
  const int32_t* counts = counts_out->typed_data();
  int32_t* packed = packed_out->typed_data();
  if (packed != packed_buf.typed_data()) std::copy(packed_buf.typed_data(), packed_buf.typed_data() + W, packed);
  for (int64_t l = 0; l < L; l++)
    for (int64_t b = 0; b < B; b++) {  // a writing row is its slot's first, its slot in range (PlanImpl)
      const int32_t* r4 = rows4 + (l * B + b) * 4;
      if (r4[1] >= 0 && slots[b] >= 0 && slots[b] < S) packed[slot_words_at + slots[b] * (2 + L) + 2 + l] = r4[0];
    }
  int32_t* stats = stats_out->typed_data();
  for (int64_t i = 0; i < N; i++) {
    uint32_t sum = static_cast<uint32_t>(stats_buf.typed_data()[i]);
    for (int64_t l = 0; l < L; l++) sum += static_cast<uint32_t>(counts[l * N + i]);
    stats[i] = static_cast<int32_t>(sum);
  }
  return ffi::Error::Success();
}

}  // namespace

// Arguments: slots, num_tokens, packed; results: rows, tokens, rows4, counts, epoch.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ArenaPlanRows, PlanImpl,
                              ffi::Ffi::Bind().Arg<I32>().Arg<I32>().Arg<I32>()
                                  .Ret<I32>().Ret<I32>().Ret<I32>().Ret<I32>().Ret<I32>()
                                  ARENA_TABLE_ATTRS.Attr<int64_t>("width").Attr<ffi::Span<const int64_t>>("counters"));

// Arguments: slots, num_tokens, packed, the counters; results: rows, tokens, rows4, counts, epoch,
// the committed packed table and counters.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ArenaPlanRowsCommit, PlanCommitImpl,
                              ffi::Ffi::Bind().Arg<I32>().Arg<I32>().Arg<I32>().Arg<I32>()
                                  .Ret<I32>().Ret<I32>().Ret<I32>().Ret<I32>().Ret<I32>().Ret<I32>().Ret<I32>()
                                  ARENA_TABLE_ATTRS.Attr<int64_t>("width").Attr<ffi::Span<const int64_t>>("counters"));
