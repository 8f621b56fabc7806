// An engine embedding kvferry through find_package(kvferry): uses only installed headers.
#include <iostream>

#include "kvferry/cache_spec.h"
#include "kvferry/rank_table.h"
#include "kvferry/status.h"

int main() {
  kvferry::Result<kvferry::CacheSpec> spec =
      kvferry::CacheSpec::Mha(2, 8, 128, 64, 16, kvferry::DType::kBFloat16);
  if (!spec.ok()) {
    std::cerr << spec.status().ToString() << "\n";
    return 1;
  }
  kvferry::RankTableGenOptions gen;
  gen.hosts = {"127.0.0.1"};
  gen.devices_per_host = 2;
  gen.prefill_count = 1;
  gen.decode_count = 1;
  kvferry::Result<kvferry::RankTable> table = kvferry::GenerateRankTable(gen);
  if (!table.ok()) {
    std::cerr << table.status().ToString() << "\n";
    return 1;
  }
  std::cout << "consumer ok: " << spec->TotalBytes() << " bytes, " << table->prefill().size() << "+"
            << table->decode().size() << " devices\n";
  return spec->TotalBytes() == 2 * 2 * 64 * 16 * 8 * 128 * 2 ? 0 : 1;
}
