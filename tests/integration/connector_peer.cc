// A prefill instance for the connector's multi-process tests: TP workers with patterned caches,
// driven by lines on stdin, reporting on stdout.
//
//   connector_peer KIND TP BASE_PORT ENGINE_ID LEASE_MS [SECRET]
//   stdin:  hold REQ N        -> finish REQ on its length cap with N fresh blocks;
//                                prints "PARAMS REQ b1,b2,... PORT TP"
//           stats             -> prints "STATS holds=H allocated=A"
//   stdout: READY; RELEASED RANK REQ (one rank's hold ended); FREED REQ (all ranks: blocks freed)
#include <atomic>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "kv_test_cache.h"
#include "kvferry/connector.h"

using namespace kvferry;

int main(int argc, char** argv) {
  if (argc < 6) {
    std::cerr << "usage: connector_peer KIND TP BASE_PORT ENGINE_ID LEASE_MS [SECRET]\n";
    return 2;
  }
  const std::string kind = argv[1];
  const int tp = std::stoi(argv[2]);
  const int base_port = std::stoi(argv[3]);
  const std::string engine = argv[4];
  const auto lease = std::chrono::milliseconds(std::stoi(argv[5]));
  const std::string secret = argc > 6 ? argv[6] : "";

  std::vector<std::unique_ptr<testing::TestCache>> caches;
  std::vector<std::unique_ptr<Worker>> workers;
  for (int r = 0; r < tp; ++r) {
    Result<CacheSpec> spec = testing::TestSpec(kind, tp, r);
    if (!spec.ok()) {
      std::cerr << spec.status().ToString() << "\n";
      return 1;
    }
    caches.push_back(std::make_unique<testing::TestCache>(*spec));
    caches.back()->FillAll();
    WorkerConfig c;
    c.role = Role::kPrefill;
    c.engine_id = engine;
    c.tp_size = tp;
    c.tp_rank = r;
    c.base_port = base_port;
    c.secret = secret;
    c.hold_lease = lease;
    // The data plane the test runs over (ctest's connector_test_ucx sets ucx; default auto).
    if (const char* t = std::getenv("KVFERRY_TEST_TRANSPORT"); t != nullptr) {  // NOLINT
      c.transport.backend = t;
    }
    Result<std::unique_ptr<Worker>> w = Worker::Create(c);
    if (!w.ok()) {
      std::cerr << w.status().ToString() << "\n";
      return 1;
    }
    Status s = (*w)->RegisterKvCaches(*spec, caches.back()->Bases());
    if (!s.ok()) {
      std::cerr << s.ToString() << "\n";
      return 1;
    }
    workers.push_back(std::move(w).value());
  }
  SchedulerConfig sc;
  sc.role = Role::kPrefill;
  sc.engine_id = engine;
  sc.base_port = base_port;
  sc.tp_size = tp;
  sc.hold_lease = lease;
  Scheduler scheduler(sc);

  std::mutex mu;
  std::set<std::int64_t> free_blocks;
  for (std::int64_t b = 0; b < caches[0]->spec().num_blocks(); ++b) free_blocks.insert(b);
  std::map<std::string, std::vector<std::int64_t>> allocated;
  std::map<std::string, std::set<int>> released;
  std::atomic<bool> done{false};

  std::thread poller([&] {
    while (!done.load()) {
      for (int r = 0; r < tp; ++r) {
        for (const std::string& id : workers[static_cast<std::size_t>(r)]->GetFinished().sending) {
          std::lock_guard<std::mutex> lock(mu);
          std::cout << "RELEASED " << r << " " << id << std::endl;
          std::set<int>& ranks = released[id];
          ranks.insert(r);
          if (static_cast<int>(ranks.size()) == tp) {
            for (std::int64_t b : allocated[id]) free_blocks.insert(b);
            allocated.erase(id);
            released.erase(id);
            std::cout << "FREED " << id << std::endl;
          }
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });

  std::cout << "READY" << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "hold") {
      std::string id;
      std::size_t n = 0;
      in >> id >> n;
      std::vector<std::int64_t> blocks;
      {
        std::lock_guard<std::mutex> lock(mu);
        // Non-contiguous on purpose: every other free block, so runs must merge and split.
        for (auto it = free_blocks.begin(); it != free_blocks.end() && blocks.size() < n;) {
          blocks.push_back(*it);
          it = free_blocks.erase(it);
          if (it != free_blocks.end() && blocks.size() % 3 == 0) ++it;
        }
        allocated[id] = blocks;
      }
      KvTransferParams params;
      params.do_remote_decode = true;
      Scheduler::FinishedResult r =
          scheduler.RequestFinished(id, params, FinishReason::kLengthCapped, blocks);
      const ConnectorMetadata meta = scheduler.BuildConnectorMeta();
      Result<ConnectorMetadata> shipped = ConnectorMetadata::Decode(meta.Encode());
      for (auto& w : workers) w->StartLoadKv(*shipped);
      std::ostringstream ids;
      for (std::size_t i = 0; i < blocks.size(); ++i) ids << (i ? "," : "") << blocks[i];
      std::lock_guard<std::mutex> lock(mu);
      std::cout << "PARAMS " << id << " " << (blocks.empty() ? "-" : ids.str()) << " "
                << *r.params->remote_port << " " << *r.params->remote_tp_size << std::endl;
      if (!r.delay_free) {
        allocated.erase(id);
        std::cout << "FREED " << id << std::endl;
      }
    } else if (cmd == "stats") {
      std::uint64_t holds = 0;
      for (auto& w : workers) holds += w->Stats().holds_outstanding;
      std::lock_guard<std::mutex> lock(mu);
      std::size_t used = 0;
      for (const auto& [id, b] : allocated) used += b.size();
      std::cout << "STATS holds=" << holds << " allocated=" << used << std::endl;
    }
  }
  done.store(true);
  poller.join();
  return 0;
}
