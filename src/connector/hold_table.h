// The prefill side's holds: blocks kept for decode readers after a request finished, the readers
// heard from, early notices, aborts and leases. Pure logic with an injected clock value, so that a
// unit test reaches every rule (DESIGN.md rules 4 and 10, 14) without threads or sockets. Not
// thread-safe: the worker calls it under its lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/clock.h"
#include "kvferry/status.h"

namespace kvferry {

struct HoldLimits {
  /// The longest a lease renewal may extend a hold from now: a renewal asking for more is
  /// clamped, so no peer can pin blocks for longer than the instance's own lease.
  std::chrono::milliseconds max_lease{120000};
  /// Early notices (a finished or abort notice for a request not held yet) kept at once. Past
  /// it, notices for unknown requests are refused with ResourceExhausted; the hold they were
  /// meant for then ends by its lease.
  std::size_t max_early = 16384;
  /// How long an early notice is kept waiting for its hold.
  std::chrono::milliseconds early_ttl{120000};
};

class HoldTable {
 public:
  /// `expected_readers(reader_tp)`: how many decode ranks of a decode instance with that TP size
  /// read this rank's blocks of one request (at least 1).
  HoldTable(HoldLimits limits, std::function<int(std::uint32_t)> expected_readers);

  /// The engine holds `id`'s blocks until its readers report or `lease` passes. Readers' notices
  /// name the hold by `key` (a layer-wise request's transfer id), or by `id` when `key` is
  /// empty; TakeReleased reports `id`. Early notices for the key apply now (it may be released at
  /// once). A second Hold of a held key is ignored.
  void Hold(const std::string& id, std::chrono::milliseconds lease, Clock::time_point now,
            const std::string& key = {});
  /// The request behind `key` ended without a hold (a layer-wise request aborted or preempted
  /// while readers read it): a finished notice naming it is answered NotFound from now on, as
  /// for a hold ended by its lease, and early notices for it are dropped.
  void Invalidate(const std::string& key);

  /// Reader `reader` (engine/dp/tp/pp) of a decode instance with TP size `reader_tp` has read
  /// `ids`; `pp_readers` of that instance's stages report each (wire::FinishedNotice), so the hold
  /// waits for expected_readers(reader_tp) * pp_readers readers.
  /// Returns how many ids were applied; ResourceExhausted (after applying the rest) when early
  /// notices for unknown ids did not fit under the cap; NotFound (after applying the rest) when
  /// the hold of one of them already ended by its lease or an abort: its blocks may have been
  /// reused while the reader read them, so the reader must not trust those bytes.
  Result<std::uint32_t> Finished(const std::string& reader, std::uint32_t reader_tp,
                                 std::span<const std::string> ids, Clock::time_point now,
                                 std::uint32_t pp_readers = 1);
  /// The decode side gave up on `ids`: their holds end now (or as soon as they are held).
  Result<std::uint32_t> Aborted(std::span<const std::string> ids, Clock::time_point now);
  /// Extends the holds of `ids` to now + min(lease, max_lease); unknown ids are skipped. Returns
  /// how many holds were renewed.
  std::uint32_t Renew(std::span<const std::string> ids, std::chrono::milliseconds lease,
                      Clock::time_point now);
  /// Ends holds whose lease passed and forgets stale early notices.
  void Expire(Clock::time_point now);

  /// Ids whose holds ended since the last call, in the order they ended.
  std::vector<std::string> TakeReleased();
  /// The keys of the same holds (equal to the ids but for layer-wise holds), since the last call.
  std::vector<std::string> TakeReleasedKeys();

  std::size_t holds() const { return holds_.size(); }
  std::size_t early() const { return early_.size(); }
  std::uint64_t released_by_readers() const { return by_readers_; }
  std::uint64_t released_by_abort() const { return by_abort_; }
  std::uint64_t expired() const { return expired_; }
  std::uint64_t early_refused() const { return early_refused_; }

 private:
  struct Held {
    std::string id;  // what TakeReleased reports
    Clock::time_point expiry;
    std::set<std::string> readers;
    int expected = -1;  // unknown until the first notice tells the readers' TP size
  };
  struct Early {
    Clock::time_point expiry;
    std::set<std::string> readers;
    std::uint32_t reader_tp = 0;
    std::uint32_t pp_readers = 1;
    bool aborted = false;
  };
  // The early entry for `id`, created if there is room; nullptr past the cap.
  Early* EarlyFor(const std::string& id, Clock::time_point now);
  // The refusal of `refused` of `total` notices of `kind` that did not fit under max_early.
  Status EarlyTableFull(const char* kind, std::size_t refused, std::size_t total) const;
  void TryComplete(const std::string& id);
  void Release(const std::string& key, std::uint64_t* counter);
  void RememberEnded(const std::string& key);

  // Ids whose holds ended by lease or abort (not by their readers), the latest 65536: a finished
  // notice for one of them reports that the reads it confirms may have seen reused blocks.
  std::unordered_set<std::string> ended_;
  std::deque<std::string> ended_order_;
  const HoldLimits limits_;
  const std::function<int(std::uint32_t)> expected_readers_;
  std::map<std::string, Held> holds_;
  std::map<std::string, Early> early_;
  std::vector<std::string> released_;
  std::vector<std::string> released_keys_;
  std::uint64_t by_readers_ = 0;
  std::uint64_t by_abort_ = 0;
  std::uint64_t expired_ = 0;
  std::uint64_t early_refused_ = 0;
};

}  // namespace kvferry
