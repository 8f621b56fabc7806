#include "transport/region_registry.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace kvferry {
namespace {

using ::testing::HasSubstr;
using namespace std::chrono_literals;

constexpr auto kEventDeadline = 10s;  // generous: only a broken registry gets near it

// Runs `f` when it goes out of scope; releases what a failed ASSERT would otherwise leave held.
template <typename F>
struct ScopeExit {
  explicit ScopeExit(F f) : f_(std::move(f)) {}
  ~ScopeExit() { f_(); }
  ScopeExit(const ScopeExit&) = delete;
  ScopeExit& operator=(const ScopeExit&) = delete;
  F f_;
};

bool Listed(const RegionRegistry& r, RegionId id) {
  for (const RegionInfo& info : r.List()) {
    if (info.id == id) return true;
  }
  return false;
}

class RegionRegistryTest : public ::testing::Test {
 protected:
  std::byte* at(std::size_t offset) { return buf_.data() + offset; }
  std::vector<std::byte> buf_ = std::vector<std::byte>(4096);
  RegionRegistry registry_;
};

TEST_F(RegionRegistryTest, AddRefusesNullEmptyAndWrappingRanges) {
  Status null = registry_.Add(1, nullptr, 16);
  EXPECT_EQ(null.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(null.message(), HasSubstr("non-null"));
  EXPECT_EQ(registry_.Add(1, at(0), 0).code(), StatusCode::kInvalidArgument);
  // Never dereferenced: the registry only does address arithmetic on it.
  void* near_top = reinterpret_cast<void*>(std::numeric_limits<std::uintptr_t>::max() - 15);
  Status wrap = registry_.Add(1, near_top, 32);
  EXPECT_EQ(wrap.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(wrap.message(), HasSubstr("wraps"));
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(RegionRegistryTest, AddRefusesDuplicateIds) {
  ASSERT_TRUE(registry_.Add(7, at(0), 100).ok());
  Status dup = registry_.Add(7, at(1000), 100);
  EXPECT_EQ(dup.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.message(), HasSubstr("already registered"));
  ASSERT_EQ(registry_.List().size(), 1u);
  EXPECT_EQ(registry_.List()[0].addr, at(0));
}

TEST_F(RegionRegistryTest, AddRefusesOverlapOnEitherSideAndAcceptsAdjacent) {
  ASSERT_TRUE(registry_.Add(1, at(1000), 1000).ok());  // [1000, 2000)
  // Starts below and reaches into it.
  Status below = registry_.Add(2, at(500), 501);
  EXPECT_EQ(below.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(below.message(), HasSubstr("overlaps region 1"));
  // Starts inside it and reaches above.
  Status above = registry_.Add(2, at(1999), 100);
  EXPECT_EQ(above.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(above.message(), HasSubstr("overlaps region 1"));
  // Inside it, and around it.
  EXPECT_FALSE(registry_.Add(2, at(1200), 10).ok());
  EXPECT_FALSE(registry_.Add(2, at(900), 1200).ok());
  EXPECT_FALSE(registry_.Add(2, at(1000), 999).ok());  // the same start, shorter: no alias
  // Touching on either side is fine.
  EXPECT_TRUE(registry_.Add(2, at(500), 500).ok());   // [500, 1000)
  EXPECT_TRUE(registry_.Add(3, at(2000), 500).ok());  // [2000, 2500)
  EXPECT_EQ(registry_.List().size(), 3u);
}

// KV cache groups sharing a tensor (vLLM's hybrid models): the same bytes under a second id are
// an alias, read under either; the address lookup survives the removal of either one.
TEST_F(RegionRegistryTest, TheSameBytesUnderAnotherIdAreAnAlias) {
  ASSERT_TRUE(registry_.Add(1, at(1000), 1000).ok());
  ASSERT_TRUE(registry_.Add(2, at(1000), 1000).ok());
  EXPECT_FALSE(registry_.Add(3, at(1000), 1000, MemoryKind{"sim", 0}).ok()) << "another kind";
  EXPECT_EQ(registry_.List().size(), 2u);
  RegionPin pin;
  Result<std::byte*> where = registry_.PinRange(2, 10, 20, &pin);
  ASSERT_TRUE(where.ok()) << where.status().ToString();
  EXPECT_EQ(*where, at(1010));
  pin = RegionPin();
  ASSERT_TRUE(registry_.Remove(1).ok());
  EXPECT_TRUE(registry_.PinLocal(at(1500), 10).ok()) << "the alias is found by address";
  ASSERT_TRUE(registry_.Remove(2).ok());
  EXPECT_FALSE(registry_.PinLocal(at(1500), 10).ok());
}

TEST_F(RegionRegistryTest, PinRangeChecksTheRangeInclusivelyAndWithoutOverflow) {
  ASSERT_TRUE(registry_.Add(1, at(0), 1000).ok());
  auto pin_range = [&](RegionId id, std::uint64_t offset, std::uint64_t length) {
    RegionPin pin;
    Result<std::byte*> where = registry_.PinRange(id, offset, length, &pin);
    EXPECT_EQ(pin.region(), where.ok() ? id : 0u);  // set only on success
    return where;
  };
  Result<std::byte*> whole = pin_range(1, 0, 1000);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(*whole, at(0));
  Result<std::byte*> last = pin_range(1, 999, 1);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(*last, at(999));

  EXPECT_EQ(pin_range(1, 0, 1001).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pin_range(1, 1000, 1).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pin_range(1, 1001, 0).status().code(), StatusCode::kInvalidArgument);
  // offset + length wraps to a small number: must still be refused.
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  EXPECT_FALSE(pin_range(1, 10, kMax - 5).ok());
  EXPECT_FALSE(pin_range(1, kMax, 2).ok());
  EXPECT_FALSE(pin_range(1, kMax - 1, kMax - 1).ok());
  EXPECT_THAT(pin_range(1, 900, 200).status().message(), HasSubstr("outside region 1"));
  // Unknown region.
  EXPECT_EQ(pin_range(9, 0, 1).status().code(), StatusCode::kInvalidArgument);
}

// Runs `f` on a thread of its own and reports whether it finished within `bound`. A thread that
// does not (a deadlock) is left behind, keeping alive what `f` captured.
bool FinishesWithin(std::function<void()> f, std::chrono::seconds bound) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  std::thread([f = std::move(f), done] {
    f();
    done->set_value();
  }).detach();
  return finished.wait_for(bound) == std::future_status::ready;
}

// PinRange into a pin that already holds one replaces it: the old pin is dropped (it once
// deadlocked here, dropping it under the registry's own lock) and the new one is held.
TEST(RegionPinTest, PinRangeIntoAHeldPinReplacesIt) {
  struct State {
    std::vector<std::byte> buf = std::vector<std::byte>(200);
    RegionRegistry registry;
    RegionPin pin;  // after the registry: dropped before it goes
    Result<std::byte*> where = Status::Internal("not run");
    std::atomic<bool> dropped{false};
  };
  auto s = std::make_shared<State>();
  ASSERT_TRUE(s->registry.Add(1, s->buf.data(), 100).ok());
  ASSERT_TRUE(s->registry.Add(2, s->buf.data() + 100, 100).ok());
  ASSERT_TRUE(s->registry.PinRange(1, 0, 10, &s->pin).ok());
  ASSERT_TRUE(
      FinishesWithin([s] { s->where = s->registry.PinRange(2, 5, 10, &s->pin); }, kEventDeadline))
      << "PinRange into a held pin deadlocked";
  ASSERT_TRUE(s->where.ok()) << s->where.status().ToString();
  EXPECT_EQ(*s->where, s->buf.data() + 105);
  EXPECT_EQ(s->pin.region(), 2u);
  // Region 1's pin is gone, region 2's is held.
  EXPECT_TRUE(FinishesWithin([s] { EXPECT_TRUE(s->registry.Remove(1).ok()); }, kEventDeadline));
  auto removal = std::make_shared<std::promise<bool>>();
  std::future<bool> removed = removal->get_future();
  std::thread([s, removal] {
    (void)s->registry.Remove(2);
    removal->set_value(s->dropped.load());
  }).detach();
  EXPECT_EQ(removed.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  s->dropped = true;
  s->pin = RegionPin();
  ASSERT_EQ(removed.wait_for(kEventDeadline), std::future_status::ready);
  EXPECT_TRUE(removed.get()) << "Remove(2) returned while region 2 was pinned";
}

TEST_F(RegionRegistryTest, PinLocalChecksTheRangeInclusivelyAndWithoutOverflow) {
  ASSERT_TRUE(registry_.Add(1, at(1000), 1000).ok());
  Result<RegionPin> whole = registry_.PinLocal(at(1000), 1000);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  EXPECT_EQ(whole->region(), 1u);
  EXPECT_TRUE(registry_.PinLocal(at(1999), 1).ok());
  EXPECT_FALSE(registry_.PinLocal(at(1999), 2).ok());
  EXPECT_FALSE(registry_.PinLocal(at(999), 1).ok());
  EXPECT_FALSE(registry_.PinLocal(at(2000), 1).ok());
  EXPECT_FALSE(registry_.PinLocal(at(1000), 1001).ok());
  EXPECT_FALSE(registry_.PinLocal(at(1500), std::numeric_limits<std::uint64_t>::max()).ok());
  Status none = registry_.PinLocal(at(3000), 8).status();
  EXPECT_EQ(none.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(none.message(), HasSubstr("register the destination memory"));
}

TEST_F(RegionRegistryTest, RemoveOfAnUnknownIdIsNotFound) {
  EXPECT_EQ(registry_.Remove(3).code(), StatusCode::kNotFound);
  ASSERT_TRUE(registry_.Add(3, at(0), 10).ok());
  EXPECT_TRUE(registry_.Remove(3).ok());
  EXPECT_EQ(registry_.Remove(3).code(), StatusCode::kNotFound);
  EXPECT_TRUE(registry_.List().empty());
  // The range is free again.
  EXPECT_TRUE(registry_.Add(4, at(0), 10).ok());
}

// Remove unlists the region at once, calls `revoke` exactly once without the registry's lock
// (List works from inside it), and returns only after the last pin is gone.
TEST_F(RegionRegistryTest, RemoveUnlistsAtOnceRevokesOnceAndWaitsForPins) {
  ASSERT_TRUE(registry_.Add(1, at(0), 1000).ok());
  ASSERT_TRUE(registry_.Add(2, at(1000), 1000).ok());
  RegionPin pin;
  ASSERT_TRUE(registry_.PinRange(1, 0, 100, &pin).ok());

  std::atomic<int> revoke_calls{0};
  std::atomic<RegionId> revoked_id{0};
  std::promise<void> revoke_entered;
  // Filled from inside `revoke`: a List() on another thread, so that a revoke called under the
  // registry's lock shows up as a timeout here instead of hanging the test.
  std::thread lister;
  bool list_returned = false;
  bool listed_inside_revoke = true;
  bool pinnable_inside_revoke = true;
  std::atomic<bool> pin_dropped{false};
  bool pin_dropped_when_removed = false;

  auto removal = std::async(std::launch::async, [&] {
    Status s = registry_.Remove(1, [&](RegionId id) {
      ++revoke_calls;
      revoked_id = id;
      auto listed = std::make_shared<std::promise<std::vector<RegionInfo>>>();
      std::future<std::vector<RegionInfo>> f = listed->get_future();
      lister = std::thread([this, listed] { listed->set_value(registry_.List()); });
      if (f.wait_for(kEventDeadline) == std::future_status::ready) {
        list_returned = true;
        listed_inside_revoke = false;
        for (const RegionInfo& info : f.get()) listed_inside_revoke |= info.id == 1;
      }
      if (list_returned) {  // else the lock is held here and PinRange would self-deadlock
        RegionPin other;
        pinnable_inside_revoke = registry_.PinRange(1, 0, 1, &other).ok();
      }
      revoke_entered.set_value();
    });
    pin_dropped_when_removed = pin_dropped.load();
    return s;
  });
  // On a failed ASSERT below: drop the pin before `removal`'s destructor waits for Remove.
  ScopeExit cleanup([&] {
    pin_dropped = true;
    pin = RegionPin();
    if (removal.valid()) removal.wait();
    if (lister.joinable()) lister.join();
  });

  ASSERT_EQ(revoke_entered.get_future().wait_for(2 * kEventDeadline), std::future_status::ready);
  // While the pin is held: unlisted, not pinnable, a second Remove is NotFound, the neighbour
  // is untouched.
  EXPECT_FALSE(Listed(registry_, 1));
  EXPECT_TRUE(Listed(registry_, 2));
  RegionPin refused;
  EXPECT_FALSE(registry_.PinRange(1, 0, 1, &refused).ok());
  EXPECT_FALSE(registry_.PinLocal(at(10), 1).ok());
  EXPECT_EQ(registry_.Remove(1).code(), StatusCode::kNotFound);

  pin_dropped = true;
  pin = RegionPin();
  ASSERT_EQ(removal.wait_for(kEventDeadline), std::future_status::ready);
  EXPECT_TRUE(removal.get().ok());
  ASSERT_TRUE(lister.joinable());
  lister.join();

  EXPECT_TRUE(pin_dropped_when_removed) << "Remove returned while a pin was held";
  EXPECT_EQ(revoke_calls.load(), 1);
  EXPECT_EQ(revoked_id.load(), 1u);
  EXPECT_TRUE(list_returned) << "List() from inside revoke deadlocked: revoke ran under the lock";
  EXPECT_FALSE(listed_inside_revoke);
  EXPECT_FALSE(pinnable_inside_revoke);
  EXPECT_EQ(registry_.Remove(1).code(), StatusCode::kNotFound);
  EXPECT_TRUE(Listed(registry_, 2));
}

TEST_F(RegionRegistryTest, PinsMoveAndUnpinOnce) {
  ASSERT_TRUE(registry_.Add(1, at(0), 100).ok());
  Result<RegionPin> a = registry_.PinLocal(at(0), 10);
  ASSERT_TRUE(a.ok());
  RegionPin b = std::move(*a);
  RegionPin c;
  ASSERT_TRUE(registry_.PinRange(1, 0, 10, &c).ok());
  c = std::move(b);  // drops c's own pin, takes b's
  b = RegionPin();   // b is empty after the move: nothing to drop
  c = RegionPin();
  // No pin left: Remove returns at once (a leaked pin would make it wait; bounded here).
  auto removal = std::async(std::launch::async, [&] { return registry_.Remove(1); });
  ASSERT_EQ(removal.wait_for(kEventDeadline), std::future_status::ready);
  EXPECT_TRUE(removal.get().ok());
}

}  // namespace
}  // namespace kvferry
