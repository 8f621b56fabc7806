// The decode side of layer-wise transfer (DESIGN rule 16): from one prefill rank's announced
// progress and what has been read from it so far, which blocks of which layers of which KV cache
// group to read now. Pure logic: it checks every announced value against the reader's own
// request before trusting it.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/clock.h"
#include "kvferry/status.h"
#include "wire/messages.h"

namespace kvferry {

/// Reads of KV cache group `group`, layers [first_layer, end_layer): blocks remote_ids[i] into
/// local_ids[i]; or, with `whole`, the group as a whole-request load reads it (a sliding window's
/// last tokens, a state block), from the blocks the announcement names: its layers are written
/// to the prompt's end.
struct LayerGroupRead {
  int group = 0;
  int first_layer = 0;
  int end_layer = 0;
  std::vector<std::int64_t> remote_ids;
  std::vector<std::int64_t> local_ids;
  bool whole = false;

  friend bool operator==(const LayerGroupRead&, const LayerGroupRead&) = default;
};

/// How a reader reads one KV cache group of its cache layer by layer.
struct LayerwiseGroup {
  int num_layers = 0;
  /// Tokens one engine block id holds, on both sides (a layer-wise load needs one block size).
  std::int64_t tokens_per_block = 1;
  /// Full attention: read as announced, chunk by chunk. False: a layer is read once it is
  /// written to the prompt's end (a sliding window's blocks are the prompt's last; a state is
  /// final only after the prefill's last chunk).
  bool progressive = true;
  /// A state group: one block per request, read whole (never progressive).
  bool state = false;
  /// The reader's blocks of the group, in prompt order.
  std::vector<std::int64_t> local_block_ids;
  /// The prompt block local_block_ids[0] holds (the load's first token / tokens_per_block);
  /// -1 when the load does not say: the tail rule (the last local_block_ids.size() of the
  /// prompt's blocks).
  std::int64_t first_block = -1;
  /// Where the load's tokens end (its first token + its token count, the prompt the prefill side
  /// computes); -1 when the load does not say. An announced prompt of another length is refused.
  std::int64_t end_token = -1;
};

/// What one reader knows of one prefill rank's transfer.
struct LayerwiseCursor {
  /// Per group and layer, the prompt tokens whose KV has been read (the block holding token
  /// tokens_read[g][l] is read again when more of it is announced: it was partly written).
  std::vector<std::vector<std::int64_t>> tokens_read;
  /// The prompt length the first announcement gave; every later one must agree.
  std::int64_t prompt_tokens = 0;

  bool Done() const;
};

/// Checks `p` (a running transfer's progress, from the rank the cursor reads) against the
/// reader's request and cache (`groups`, one per KV cache group; `remote_num_blocks[g]` the
/// prefill cache's blocks of group g, or empty when not known yet: the ranges are then not
/// checked). InvalidArgument, with nothing changed, for progress that contradicts them or an
/// earlier announcement: another number of groups, a prompt too short for the local blocks or a
/// different prompt length, fewer block ids than the tokens announced need, block ids outside
/// the remote cache, layers past a group's, or tokens announced that go back.
Status CheckLayerwiseProgress(const wire::Progress& p, std::span<const LayerwiseGroup> groups,
                              std::span<const std::int64_t> remote_num_blocks,
                              const LayerwiseCursor& cursor);

/// CheckLayerwiseProgress, then the reads that bring every layer up to what `p` announces
/// (runs of consecutive layers of a group with the same blocks to read), advancing `cursor`.
Result<std::vector<LayerGroupRead>> PlanLayerwiseReads(
    const wire::Progress& p, std::span<const LayerwiseGroup> groups,
    std::span<const std::int64_t> remote_num_blocks, LayerwiseCursor& cursor);

/// What `p`'s announcements brought every layer of `groups` to: the cursor a newer announcement
/// from the same rank is checked against.
LayerwiseCursor AnnouncedCursor(const wire::Progress& p, std::span<const LayerwiseGroup> groups);

/// What a layer-wise load does when its prefill ranks have announced nothing new since its last
/// step: wait, poll them (Subscribe again; the reply carries their progress) or fail.
enum class SilenceStep { kWait, kPoll, kFail };

/// At `now`, with `limit` the start or progress deadline in force, `heard` the last fresh
/// announcement or poll, `polled` the last poll answered: a poll every `poll_every` of silence;
/// at the limit, a failure only when a poll answered within `poll_every` before it brought
/// nothing. Silence is judged by asking: a step that runs past its limit without such a poll (its
/// threads were busy under load, and the pushes that would have woken it were lost) polls first.
SilenceStep OnSilence(Clock::time_point now, Clock::time_point limit, Clock::time_point heard,
                      Clock::time_point polled, Clock::duration poll_every);

}  // namespace kvferry
