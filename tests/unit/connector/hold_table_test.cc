// The prefill side's hold table (DESIGN.md rules 4, 10 and 14), with injected clock values.
#include "connector/hold_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvferry {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using namespace std::chrono_literals;

const Clock::time_point kT0 = Clock::time_point() + 1000h;

// A decode instance with TP size t has t readers of this rank's blocks.
HoldTable MakeTable(HoldLimits limits = {}) {
  return HoldTable(limits, [](std::uint32_t reader_tp) { return static_cast<int>(reader_tp); });
}

std::vector<std::string> Ids(std::initializer_list<const char*> ids) {
  return {ids.begin(), ids.end()};
}

TEST(HoldTableTest, HeldRequestIsReleasedWhenEveryExpectedReaderReported) {
  HoldTable t = MakeTable();
  t.Hold("a", 60s, kT0);
  EXPECT_EQ(t.holds(), 1u);
  const auto a = Ids({"a"});
  Result<std::uint32_t> first = t.Finished("decode/0/0", 2, a, kT0 + 1s);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 1u);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());  // 1 of 2 readers
  // The same reader again counts once.
  ASSERT_TRUE(t.Finished("decode/0/0", 2, a, kT0 + 2s).ok());
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  EXPECT_EQ(t.holds(), 1u);
  ASSERT_TRUE(t.Finished("decode/0/1", 2, a, kT0 + 3s).ok());
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a"));
  EXPECT_EQ(t.holds(), 0u);
  EXPECT_EQ(t.released_by_readers(), 1u);
  EXPECT_EQ(t.released_by_abort(), 0u);
  EXPECT_EQ(t.expired(), 0u);
}

// Unequal pipeline sizes (issue 28): every stage of the decode instance tells every prefill
// stage, so a hold waits for pp_readers times the TP readers, each stage's reader its own, and an
// early notice keeps the count for the hold it precedes.
TEST(HoldTableTest, EveryDecodeStageIsAReaderWherePipelinesDiffer) {
  HoldTable t = MakeTable();
  t.Hold("a", 60s, kT0);
  const auto a = Ids({"a"});
  for (const char* reader : {"d/0/0", "d/0/0/pp1", "d/0/1"}) {
    ASSERT_TRUE(t.Finished(reader, 2, a, kT0 + 1s, 2).ok());
    EXPECT_THAT(t.TakeReleased(), IsEmpty()) << reader;
  }
  ASSERT_TRUE(t.Finished("d/0/1/pp1", 2, a, kT0 + 2s, 2).ok());
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a"));
  const auto b = Ids({"b"});
  ASSERT_TRUE(t.Finished("d/0/0", 1, b, kT0 + 3s, 3).ok());  // before its hold
  t.Hold("b", 60s, kT0 + 4s);
  ASSERT_TRUE(t.Finished("d/0/0/pp1", 1, b, kT0 + 5s, 3).ok());
  EXPECT_THAT(t.TakeReleased(), IsEmpty()) << "2 of 3 stages";
  ASSERT_TRUE(t.Finished("d/0/0/pp2", 1, b, kT0 + 6s, 3).ok());
  EXPECT_THAT(t.TakeReleased(), ElementsAre("b"));
}

// A reader that reports after the hold ended by lease or abort read blocks that may have been
// reused meanwhile: its notice is refused with NotFound, so it does not trust those bytes (found
// by the two-host test: a 3 s link outage outlived a 4 s lease with TCP's backoff, and the decode
// side verified another request's KV). A hold ended by its readers is not refused.
TEST(HoldTableTest, AReaderReportingAfterTheHoldExpiredOrWasAbortedIsToldItsBytesAreStale) {
  HoldTable t = MakeTable();
  t.Hold("expired", 1s, kT0);
  t.Hold("aborted", 60s, kT0);
  t.Hold("done", 60s, kT0);
  t.Expire(kT0 + 2s);
  ASSERT_TRUE(t.Aborted(Ids({"aborted"}), kT0 + 2s).ok());
  ASSERT_TRUE(t.Finished("decode/0/0", 1, Ids({"done"}), kT0 + 2s).ok());
  for (const char* id : {"expired", "aborted"}) {
    Result<std::uint32_t> late = t.Finished("decode/0/0", 1, Ids({id}), kT0 + 3s);
    ASSERT_FALSE(late.ok()) << id;
    EXPECT_EQ(late.status().code(), StatusCode::kNotFound);
    EXPECT_THAT(late.status().message(), HasSubstr("must not be used"));
  }
  // A second report of a request its readers completed is kept as an early notice, as before.
  EXPECT_TRUE(t.Finished("decode/0/1", 1, Ids({"done"}), kT0 + 3s).ok());
}

TEST(HoldTableTest, SecondHoldOfAHeldIdIsIgnored) {
  HoldTable t = MakeTable();
  t.Hold("a", 10s, kT0);
  t.Hold("a", 100s, kT0 + 5s);  // must not extend the lease
  t.Expire(kT0 + 10s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a"));
}

TEST(HoldTableTest, EarlyNoticesApplyAtHold) {
  HoldTable t = MakeTable();
  const auto a = Ids({"a"});
  const auto b = Ids({"b"});
  // Complete before the hold: released the moment it is held.
  ASSERT_TRUE(t.Finished("r0", 1, a, kT0).ok());
  // One of two readers before the hold, the other after.
  ASSERT_TRUE(t.Finished("r0", 2, b, kT0).ok());
  EXPECT_EQ(t.early(), 2u);
  EXPECT_EQ(t.holds(), 0u);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());

  t.Hold("a", 60s, kT0 + 1s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a"));
  t.Hold("b", 60s, kT0 + 1s);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  EXPECT_EQ(t.early(), 0u);
  ASSERT_TRUE(t.Finished("r0", 2, b, kT0 + 2s).ok());  // a repeat: still one reader
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  ASSERT_TRUE(t.Finished("r1", 2, b, kT0 + 2s).ok());
  EXPECT_THAT(t.TakeReleased(), ElementsAre("b"));
  EXPECT_EQ(t.released_by_readers(), 2u);
}

TEST(HoldTableTest, EarlyAbortReleasesAtHold) {
  HoldTable t = MakeTable();
  const auto a = Ids({"a"});
  Result<std::uint32_t> applied = t.Aborted(a, kT0);
  ASSERT_TRUE(applied.ok());
  EXPECT_EQ(*applied, 1u);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  t.Hold("a", 60s, kT0 + 1s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a"));
  EXPECT_EQ(t.holds(), 0u);
  EXPECT_EQ(t.early(), 0u);
  EXPECT_EQ(t.released_by_abort(), 1u);
}

TEST(HoldTableTest, AbortOfAHeldIdReleasesIt) {
  HoldTable t = MakeTable();
  t.Hold("a", 60s, kT0);
  t.Hold("b", 60s, kT0);
  ASSERT_TRUE(t.Finished("r0", 2, Ids({"a"}), kT0).ok());  // partly read, then aborted
  Result<std::uint32_t> applied = t.Aborted(Ids({"a"}), kT0 + 1s);
  ASSERT_TRUE(applied.ok());
  EXPECT_EQ(*applied, 1u);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a"));
  EXPECT_EQ(t.holds(), 1u);
  EXPECT_EQ(t.released_by_abort(), 1u);
  EXPECT_EQ(t.released_by_readers(), 0u);
  // A late notice for the released id is refused (its bytes may be stale) and does not
  // resurrect or release anything held.
  EXPECT_EQ(t.Finished("r1", 2, Ids({"a"}), kT0 + 2s).status().code(), StatusCode::kNotFound);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  EXPECT_EQ(t.holds(), 1u);
}

TEST(HoldTableTest, LeaseExpiryReleases) {
  HoldLimits limits;
  limits.max_lease = 60s;
  HoldTable t = MakeTable(limits);
  t.Hold("a", 10s, kT0);
  t.Hold("b", 20s, kT0);
  t.Hold("c", 10min, kT0);  // clamped to max_lease
  ASSERT_TRUE(t.Finished("r0", 2, Ids({"a"}), kT0).ok());
  t.Expire(kT0 + 10s - 1ms);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  t.Expire(kT0 + 10s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a"));
  t.Expire(kT0 + 59s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("b"));
  t.Expire(kT0 + 60s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("c"));
  EXPECT_EQ(t.expired(), 3u);
  EXPECT_EQ(t.holds(), 0u);
}

TEST(HoldTableTest, TakeReleasedKeepsOrderAndReportsEachIdOnce) {
  HoldTable t = MakeTable();
  for (const char* id : {"a", "b", "c", "d"}) t.Hold(id, 60s, kT0);
  ASSERT_TRUE(t.Aborted(Ids({"c"}), kT0).ok());
  ASSERT_TRUE(t.Finished("r0", 1, Ids({"a"}), kT0).ok());
  t.Expire(kT0 + 60s);  // b and d
  EXPECT_THAT(t.TakeReleased(), ElementsAre("c", "a", "b", "d"));
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  ASSERT_TRUE(t.Aborted(Ids({"a"}), kT0 + 61s).ok());  // already released: an early entry
  t.Expire(kT0 + 62s);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
}

TEST(HoldTableTest, RenewExtendsClampedToMaxLease) {
  HoldLimits limits;
  limits.max_lease = 10s;
  HoldTable t = MakeTable(limits);
  t.Hold("a", 5s, kT0);
  t.Hold("b", 5s, kT0);
  const auto ab = Ids({"a", "b", "unknown"});
  EXPECT_EQ(t.Renew(ab, 1h, kT0 + 4s), 2u);  // until kT0 + 14s, not + 1h
  t.Expire(kT0 + 14s - 1ms);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  t.Expire(kT0 + 14s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a", "b"));
}

TEST(HoldTableTest, RenewNeverShortensAndSkipsUnknownIds) {
  HoldTable t = MakeTable();
  t.Hold("a", 30s, kT0);
  EXPECT_EQ(t.Renew(Ids({"a"}), 1s, kT0 + 1s), 1u);  // would end at +2s: keeps +30s
  t.Expire(kT0 + 29s);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  EXPECT_EQ(t.Renew(Ids({"x", "y"}), 10s, kT0), 0u);
  EXPECT_EQ(t.holds(), 1u);
  EXPECT_EQ(t.early(), 0u);  // renewals never create early entries
}

TEST(HoldTableTest, EarlyCapRefusesNewUnknownIdsButAppliesTheRest) {
  HoldLimits limits;
  limits.max_early = 2;
  HoldTable t = MakeTable(limits);
  t.Hold("held", 60s, kT0);
  ASSERT_TRUE(t.Finished("r0", 1, Ids({"u1"}), kT0).ok());
  ASSERT_TRUE(t.Aborted(Ids({"u2"}), kT0).ok());
  EXPECT_EQ(t.early(), 2u);

  // The table of early notices is full: "u3" is refused, the held id and the known early id
  // in the same call still apply.
  Result<std::uint32_t> r = t.Finished("r1", 1, Ids({"u3", "held", "u1"}), kT0 + 1s);
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("1 of 3"));
  EXPECT_THAT(r.status().message(), HasSubstr("(2)"));
  EXPECT_THAT(t.TakeReleased(), ElementsAre("held"));
  EXPECT_EQ(t.early(), 2u);
  EXPECT_EQ(t.early_refused(), 1u);

  Result<std::uint32_t> a = t.Aborted(Ids({"u4", "u5", "u2"}), kT0 + 1s);
  EXPECT_EQ(a.status().code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(a.status().message(), HasSubstr("2 of 3"));
  EXPECT_THAT(a.status().message(), HasSubstr("(2)"));
  EXPECT_EQ(t.early_refused(), 3u);

  // The kept early notices still apply at Hold; the refused ones left nothing behind.
  t.Hold("u1", 60s, kT0 + 2s);
  t.Hold("u2", 60s, kT0 + 2s);
  t.Hold("u3", 60s, kT0 + 2s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("u1", "u2"));
  EXPECT_EQ(t.holds(), 1u);  // u3: held until its readers report or its lease ends
  EXPECT_EQ(t.released_by_readers(), 2u);
  EXPECT_EQ(t.released_by_abort(), 1u);
}

TEST(HoldTableTest, EarlyNoticesExpireAfterTheirTtl) {
  HoldLimits limits;
  limits.early_ttl = 5s;
  limits.max_early = 1;
  HoldTable t = MakeTable(limits);
  ASSERT_TRUE(t.Finished("r0", 1, Ids({"a"}), kT0).ok());
  t.Expire(kT0 + 5s - 1ms);
  EXPECT_EQ(t.early(), 1u);
  EXPECT_FALSE(t.Finished("r0", 1, Ids({"b"}), kT0 + 1s).ok());  // full
  t.Expire(kT0 + 5s);
  EXPECT_EQ(t.early(), 0u);
  // Forgotten: the hold now waits for its readers.
  t.Hold("a", 60s, kT0 + 6s);
  EXPECT_THAT(t.TakeReleased(), IsEmpty());
  // And the freed slot takes a new early notice.
  EXPECT_TRUE(t.Finished("r0", 1, Ids({"b"}), kT0 + 6s).ok());
  EXPECT_EQ(t.early(), 1u);
  EXPECT_EQ(t.expired(), 0u);  // early expiry is not a hold's lease expiry
}

TEST(HoldTableTest, ARepeatedEarlyNoticeRefreshesItsTtl) {
  HoldLimits limits;
  limits.early_ttl = 5s;
  HoldTable t = MakeTable(limits);
  ASSERT_TRUE(t.Finished("r0", 2, Ids({"a"}), kT0).ok());
  ASSERT_TRUE(t.Finished("r1", 2, Ids({"a"}), kT0 + 4s).ok());
  t.Expire(kT0 + 6s);
  EXPECT_EQ(t.early(), 1u);
  t.Hold("a", 60s, kT0 + 7s);
  EXPECT_THAT(t.TakeReleased(), ElementsAre("a"));
}

}  // namespace
}  // namespace kvferry
