// `reserve`'s table work as one XLA FFI call on a CPU: what `pallas_kernels/gpu/allocate.py`'s
// Triton kernel does, row after row, with the same rules and in the same order of writes (its
// reference: `arena_jax.allocator.reserve_impl`'s jnp ops; tests/test_kernels_allocate.py compares
// the three). Built on first use by `pallas_kernels/cpu/allocate.py` against the installed jaxlib's
// FFI headers. Every index is clipped into its region: any table leaves memory untouched outside it.
#include <cstring>
#include <vector>

#include "table.h"

namespace {

using namespace arena_native;

struct Geometry {
  int64_t max_seqs, max_pages, num_layers, num_pages, page_size;
  int64_t page_map_at, slot_words_at, page_words_at, words_at, pad_slot;
  int64_t counters[5];  // pages_allocated, cow_copies, metadata_ops, failed_reservations, rejected_rows
};

// Returns an error message, or nullptr. `packed` / `counts`: the table and counters, updated in place.
const char* Reserve(const Geometry& g, int64_t batch, const int32_t* slots, const int32_t* asked, int32_t* packed,
                    int64_t words, int32_t* counts, int64_t num_counts, int32_t* served, int32_t* cow_src,
                    int32_t* cow_dst, char* k, char* v, int64_t page_bytes, int64_t pages_per_arena) {
  const int64_t S = g.max_seqs, M = g.max_pages, P = g.num_pages, ps = g.page_size;
  const int64_t refcount_at = g.page_words_at + P;
  if (S <= 0 || M <= 0 || P <= 0 || ps <= 0 || refcount_at + P > words || g.words_at + 3 > words ||
      g.page_map_at + S * M > words || g.slot_words_at + S * (2 + g.num_layers) > words)
    return "reserve_pages: the geometry and offsets do not fit the packed table";
  for (int64_t c : g.counters)
    if (c < 0 || c >= num_counts) return "reserve_pages: a counter's place is outside the counters";
  auto at = [&](int64_t i) -> int32_t& { return packed[clip(i, 0, words - 1)]; };
  const int64_t num_free = packed[g.words_at];
  std::vector<int64_t> idx(batch), length(batch), n(batch), last_lp(batch), last_page(batch), last_refs(batch),
      have(batch), need(batch), demand(batch), granted(batch), first(batch), cow_page(batch);
  std::vector<char> live(batch), wants_cow(batch), keeper(batch), cow(batch), ok(batch), do_cow(batch), pad(batch);
  // The rows, classified: a slot named twice is served at its first row; a count past the
  // slot's room is refused (`n <= room`, never a sum that overflows).
  for (int64_t b = 0; b < batch; b++) {
    const int64_t slot = slots[b];
    const bool in_range = slot >= 0 && slot < S;
    idx[b] = in_range ? slot : 0;
    bool named_before = false;
    for (int64_t o = 0; o < b && in_range; o++) named_before |= slots[o] == slot;
    const bool first_named = in_range && !named_before;
    length[b] = first_named ? at(g.slot_words_at + idx[b] * (2 + g.num_layers)) : 0;
    live[b] = first_named && asked[b] >= 0 && asked[b] <= M * ps - length[b];
    n[b] = live[b] ? asked[b] : 0;
    last_lp[b] = std::min(length[b] / ps, M - 1);
    last_page[b] = at(g.page_map_at + idx[b] * M + last_lp[b]);
    last_refs[b] = at(refcount_at + clip(last_page[b], 0, P - 1));
    have[b] = (length[b] + ps - 1) / ps;
    need[b] = (length[b] + n[b] + ps - 1) / ps;
    wants_cow[b] = live[b] && n[b] > 0 && length[b] % ps != 0 && last_refs[b] > 1;
    pad[b] = slot == g.pad_slot;
  }
  auto same = [&](int64_t b, int64_t o) { return wants_cow[b] && wants_cow[o] && last_page[b] == last_page[o]; };
  // Who keeps a shared page (its first holder in the batch, when every holder is here), first
  // come first served, pops counted from the stack's top.
  const int64_t cap = P + 1;  // any demand above num_free fails alike
  int64_t upto = 0;
  for (int64_t b = 0; b < batch; b++) {
    int64_t before = 0, all = 0;
    for (int64_t o = 0; o < batch; o++) {
      all += same(b, o);
      before += o < b && same(b, o);
    }
    keeper[b] = before == 0 && all == last_refs[b];
    cow[b] = wants_cow[b] && !keeper[b];
    demand[b] = std::min(live[b] ? need[b] - have[b] + cow[b] : 0, cap);
    upto = std::min(upto + demand[b], cap);
    ok[b] = live[b] && (demand[b] == 0 || upto <= num_free);
  }
  std::vector<char> refused(batch);
  for (int64_t b = 0; b < batch; b++) refused[b] = cow[b] && !ok[b];
  for (int64_t b = 0; b < batch; b++) {
    bool holder_refused = false;
    for (int64_t o = 0; o < batch; o++) holder_refused |= same(b, o) && refused[o];
    ok[b] = ok[b] && !(wants_cow[b] && keeper[b] && holder_refused);
  }
  int64_t popped_total = 0;
  for (int64_t b = 0; b < batch; b++) {
    granted[b] = ok[b] ? demand[b] : 0;
    first[b] = popped_total;
    popped_total += granted[b];
    do_cow[b] = ok[b] && cow[b];
  }
  auto popped = [&](int64_t i) -> int64_t { return at(g.page_words_at + clip(num_free - 1 - i, 0, P - 1)); };
  // Refcounts: -k once for a shared page k rows of the batch copy away from, 1 for each popped
  // page; the page map: the private copy over the shared last page, new pages past the held ones.
  for (int64_t b = 0; b < batch; b++) cow_page[b] = do_cow[b] ? popped(first[b]) : P;
  for (int64_t b = 0; b < batch; b++) {
    if (!do_cow[b]) continue;
    int64_t before = 0, all = 0;
    for (int64_t o = 0; o < batch; o++) {
      const bool leaving = do_cow[o] && last_page[o] == last_page[b];
      all += leaving;
      before += o < b && leaving;
    }
    if (before == 0 && all > 0) at(refcount_at + clip(last_page[b], 0, P - 1)) = last_refs[b] - all;
  }
  for (int64_t b = 0; b < batch; b++) {
    if (!do_cow[b]) continue;
    at(refcount_at + clip(cow_page[b], 0, P - 1)) = 1;
    at(g.page_map_at + idx[b] * M + last_lp[b]) = cow_page[b];
  }
  for (int64_t b = 0; b < batch; b++) {
    if (!ok[b]) continue;
    for (int64_t lp = have[b]; lp < std::min(need[b], M); lp++) {
      const int64_t page = popped(first[b] + cow[b] + lp - have[b]);
      at(refcount_at + clip(page, 0, P - 1)) = 1;
      at(g.page_map_at + idx[b] * M + lp) = page;
    }
  }
  // The served rows' lengths and flags, then num_free.
  for (int64_t b = 0; b < batch; b++) {
    if (!ok[b]) continue;
    const int64_t length_at = g.slot_words_at + idx[b] * (2 + g.num_layers);
    at(length_at) = length[b] + n[b];
    at(length_at + 1) = 1;
  }
  packed[g.words_at] = static_cast<int32_t>(num_free - popped_total);
  // The counters (wrapping as int32 adds do): pages popped, copies, reservations that moved no
  // data, rows refused for want of pages, rows rejected (padding is neither).
  int64_t events[5] = {popped_total, 0, 0, 0, 0};
  for (int64_t b = 0; b < batch; b++) {
    events[1] += do_cow[b];
    events[2] += ok[b] && n[b] > 0 && demand[b] == 0;
    events[3] += live[b] && !ok[b];
    events[4] += !pad[b] && !live[b];
  }
  for (int i = 0; i < 5; i++) {
    uint32_t& c = reinterpret_cast<uint32_t&>(counts[g.counters[i]]);
    c += static_cast<uint32_t>(events[i]);
  }
  for (int64_t b = 0; b < batch; b++) {
    served[b] = ok[b] || pad[b];
    cow_src[b] = static_cast<int32_t>(do_cow[b] ? last_page[b] : 0);
    cow_dst[b] = static_cast<int32_t>(cow_page[b]);
  }
  // A float arena's copy-on-write copies: page dst := page src of every layer and head.
  if (k != nullptr) {
    for (int64_t b = 0; b < batch; b++) {
      if (!do_cow[b]) continue;
      const int64_t src = clip(last_page[b], 0, P - 1), dst = clip(cow_page[b], 0, P - 1);
      for (int64_t lh = 0; lh < pages_per_arena / P; lh++)
        for (char* arena : {k, v})
          std::memcpy(arena + (lh * P + dst) * page_bytes, arena + (lh * P + src) * page_bytes, page_bytes);
    }
  }
  return nullptr;
}

Geometry MakeGeometry(int64_t max_seqs, int64_t max_pages, int64_t num_layers, int64_t num_pages, int64_t page_size,
                      int64_t page_map_at, int64_t slot_words_at, int64_t page_words_at, int64_t words_at,
                      int64_t pad_slot, ffi::Span<const int64_t> counters) {
  Geometry g{max_seqs, max_pages, num_layers, num_pages, page_size, page_map_at, slot_words_at, page_words_at,
             words_at, pad_slot, {-1, -1, -1, -1, -1}};
  for (size_t i = 0; i < 5 && i < counters.size(); i++) g.counters[i] = counters[i];
  return g;
}

void Alias(const void* from, void* to, size_t bytes) {  // outputs alias inputs; copy if XLA did not
  if (from != to) std::memmove(to, from, bytes);
}

ffi::Error Run(const Geometry& g, I32 slots, I32 asked,
               I32 packed_in, I32 counts_in, ffi::AnyBuffer* k_in,
               ffi::AnyBuffer* v_in, I32Out& packed, I32Out& counts,
               ffi::Result<ffi::AnyBuffer>* k, ffi::Result<ffi::AnyBuffer>* v, I32Out& served,
               I32Out& cow_src, I32Out& cow_dst) {
  const int64_t batch = slots.element_count();
  if (static_cast<int64_t>(asked.element_count()) != batch || static_cast<int64_t>(served->element_count()) != batch)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "reserve_pages: slots, num_tokens and rows differ in length");
  Alias(packed_in.untyped_data(), packed->untyped_data(), packed_in.size_bytes());
  Alias(counts_in.untyped_data(), counts->untyped_data(), counts_in.size_bytes());
  char *k_data = nullptr, *v_data = nullptr;
  int64_t page_bytes = 0, pages = 0;
  if (k_in != nullptr) {
    Alias(k_in->untyped_data(), (*k)->untyped_data(), k_in->size_bytes());
    Alias(v_in->untyped_data(), (*v)->untyped_data(), v_in->size_bytes());
    auto dims = k_in->dimensions();  // [L, H, P, S, D]
    if (dims.size() != 5 || dims[2] != g.num_pages || v_in->size_bytes() != k_in->size_bytes())
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, "reserve_pages: arenas must be [L, H, num_pages, S, D]");
    page_bytes = static_cast<int64_t>(k_in->size_bytes()) / (dims[0] * dims[1] * dims[2]);
    pages = dims[0] * dims[1] * dims[2];
    k_data = static_cast<char*>((*k)->untyped_data());
    v_data = static_cast<char*>((*v)->untyped_data());
  }
  const char* error = Reserve(g, batch, slots.typed_data(), asked.typed_data(), packed->typed_data(),
                              packed->element_count(), counts->typed_data(), counts->element_count(),
                              served->typed_data(), cow_src->typed_data(), cow_dst->typed_data(), k_data, v_data,
                              page_bytes, pages);
  if (error != nullptr) return ffi::Error(ffi::ErrorCode::kInvalidArgument, error);
  return ffi::Error::Success();
}

ffi::Error ReserveTable(I32 slots, I32 asked, I32 packed_in,
                        I32 counts_in, I32Out packed,
                        I32Out counts, I32Out served,
                        I32Out cow_src, I32Out cow_dst,
                        int64_t max_seqs, int64_t max_pages, int64_t num_layers, int64_t num_pages, int64_t page_size,
                        int64_t page_map_at, int64_t slot_words_at, int64_t page_words_at, int64_t words_at,
                        int64_t pad_slot, ffi::Span<const int64_t> counters) {
  Geometry g = MakeGeometry(max_seqs, max_pages, num_layers, num_pages, page_size, page_map_at, slot_words_at,
                            page_words_at, words_at, pad_slot, counters);
  return Run(g, slots, asked, packed_in, counts_in, nullptr, nullptr, packed, counts, nullptr, nullptr, served,
             cow_src, cow_dst);
}

ffi::Error ReserveTableAndCopy(I32 slots, I32 asked,
                               I32 packed_in, I32 counts_in, ffi::AnyBuffer k_in,
                               ffi::AnyBuffer v_in, I32Out packed,
                               I32Out counts, ffi::Result<ffi::AnyBuffer> k,
                               ffi::Result<ffi::AnyBuffer> v, I32Out served,
                               I32Out cow_src, I32Out cow_dst,
                               int64_t max_seqs, int64_t max_pages, int64_t num_layers, int64_t num_pages,
                               int64_t page_size, int64_t page_map_at, int64_t slot_words_at, int64_t page_words_at,
                               int64_t words_at, int64_t pad_slot, ffi::Span<const int64_t> counters) {
  Geometry g = MakeGeometry(max_seqs, max_pages, num_layers, num_pages, page_size, page_map_at, slot_words_at,
                            page_words_at, words_at, pad_slot, counters);
  return Run(g, slots, asked, packed_in, counts_in, &k_in, &v_in, packed, counts, &k, &v, served, cow_src, cow_dst);
}

}  // namespace

// Arguments: slots, num_tokens, packed, counts (and k, v); results: packed, counts (k, v), served, cow_src, cow_dst.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ArenaReservePages, ReserveTable,
                              ffi::Ffi::Bind().Arg<I32>().Arg<I32>().Arg<I32>().Arg<I32>()
                                  .Ret<I32>().Ret<I32>().Ret<I32>().Ret<I32>().Ret<I32>()
                                  ARENA_TABLE_ATTRS.Attr<ffi::Span<const int64_t>>("counters"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ArenaReservePagesCopy, ReserveTableAndCopy,
                              ffi::Ffi::Bind().Arg<I32>().Arg<I32>().Arg<I32>().Arg<I32>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<I32>().Ret<I32>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<I32>().Ret<I32>().Ret<I32>()
                                  ARENA_TABLE_ATTRS.Attr<ffi::Span<const int64_t>>("counters"));
