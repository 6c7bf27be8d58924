// What the native calls share: the page table's FFI attributes and int32 buffer types, clipping.
#pragma once

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace arena_native {

namespace ffi = xla::ffi;
using I32 = ffi::Buffer<ffi::S32>;
using I32Out = ffi::Result<ffi::Buffer<ffi::S32>>;

inline int64_t clip(int64_t x, int64_t lo, int64_t hi) { return std::min(std::max(x, lo), hi); }

}  // namespace arena_native

// The packed table's geometry and region offsets, then the padding slot (as `arena_jax.kv_cache._regions`).
#define ARENA_TABLE_ATTRS                                                                                  \
  .Attr<int64_t>("max_seqs").Attr<int64_t>("max_pages").Attr<int64_t>("num_layers").Attr<int64_t>("num_pages") \
      .Attr<int64_t>("page_size").Attr<int64_t>("page_map_at").Attr<int64_t>("slot_words_at")                  \
      .Attr<int64_t>("page_words_at").Attr<int64_t>("words_at").Attr<int64_t>("pad_slot")
