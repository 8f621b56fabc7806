// libFuzzer target: the rank-table parser must turn any text into a table or an error. A parsed
// table must survive its own JSON form unchanged.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "kvferry/rank_table.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  kvferry::Result<kvferry::RankTable> t = kvferry::RankTable::Parse(text, "fuzz");
  if (!t.ok()) return 0;
  kvferry::Result<kvferry::RankTable> again = kvferry::RankTable::Parse(t->ToJson(), "again");
  if (!again.ok() || again->prefill() != t->prefill() || again->decode() != t->decode()) {
    std::abort();
  }
  return 0;
}
