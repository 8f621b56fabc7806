// The decode side of layer-wise transfer (DESIGN rule 16): from one prefill rank's announced
// progress and what has been read from it so far, which blocks of which layers to read now. Pure
// logic: it checks every announced value against the reader's own request before trusting it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvferry/status.h"
#include "wire/messages.h"

namespace kvferry {

/// Blocks to read for layers [first_layer, end_layer): remote_ids[i] into local_ids[i].
struct LayerGroupRead {
  int first_layer = 0;
  int end_layer = 0;
  std::vector<std::int64_t> remote_ids;
  std::vector<std::int64_t> local_ids;

  friend bool operator==(const LayerGroupRead&, const LayerGroupRead&) = default;
};

/// What one reader knows of one prefill rank's transfer.
struct LayerwiseCursor {
  /// Per layer, the prompt tokens whose KV has been read (the block holding token
  /// tokens_read[l] is read again when more of it is announced: it was partly written).
  std::vector<std::int64_t> tokens_read;
  /// The prompt length the first announcement gave; every later one must agree.
  std::int64_t prompt_tokens = 0;

  bool Done() const;
};

/// Checks `p` (a running transfer's progress, from the rank the cursor reads) against the
/// reader's request: `local_block_ids` are the blocks it allocated for the tail of the prompt
/// (as in the tail rule: the last n blocks of the prompt), blocks hold `tokens_per_block`
/// tokens, the cache has `num_layers` layers and the remote one `remote_num_blocks` blocks. Then
/// returns the reads that bring every layer up to what `p` announces (groups of consecutive
/// layers with the same blocks to read) and advances `cursor` to it. InvalidArgument, with the
/// cursor unchanged, for progress that contradicts the request or an earlier announcement: a
/// prompt too short for the local blocks or a different prompt length, fewer block ids than
/// the tokens announced need, block ids outside the remote cache, layers past the cache's,
/// or tokens announced that go back.
Result<std::vector<LayerGroupRead>> PlanLayerwiseReads(
    const wire::Progress& p, std::span<const std::int64_t> local_block_ids,
    std::int64_t tokens_per_block, int num_layers, std::int64_t remote_num_blocks,
    LayerwiseCursor& cursor);

/// The checks of PlanLayerwiseReads alone, for a progress message before it is kept;
/// `remote_num_blocks` 0 when not known yet (the block range is then not checked).
Status CheckLayerwiseProgress(const wire::Progress& p, std::size_t local_blocks,
                              std::int64_t tokens_per_block, int num_layers,
                              const LayerwiseCursor& cursor, std::int64_t remote_num_blocks);

}  // namespace kvferry
