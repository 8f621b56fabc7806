// A prefill instance for the connector's multi-process tests: TP workers with patterned caches,
// driven by lines on stdin, reporting on stdout.
//
//   connector_peer KIND TP BASE_PORT ENGINE_ID LEASE_MS [SECRET]
//   stdin:  hold REQ N        -> finish REQ on its length cap with N fresh blocks;
//                                prints "PARAMS REQ b1,b2,... PORT TP"
//           stats             -> prints "STATS holds=H allocated=A"
//           count TYPE        -> prints "COUNT TYPE N": side-channel messages of TYPE received
//                                (finished, abort, subscribe, ...), summed over the ranks
//   Layer-wise (docs/layerwise.md), as an engine drives a request with a transfer id:
//           lw_step REQ XFER FIRST END PROMPT -> a step that computes prompt tokens [FIRST, END)
//                                of REQ (blocks allocated as needed and scrambled, so a layer read
//                                before it is written fails the reader's check); prints
//                                "LWSTEP REQ b1,b2,..."
//           lw_layer L        -> writes layer L of the step's blocks and calls SaveKvLayer(L) on
//                                every rank; prints "LAYER L"
//           lw_finish REQ     -> REQ stops on its length cap: held under its transfer id;
//                                prints "HELD REQ"
//           lw_abort REQ      -> REQ is aborted: its transfer ends, its blocks are freed
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

  // Layer-wise requests: params and blocks by request id, and the blocks the current step writes.
  std::map<std::string, KvTransferParams> lw_params;
  std::vector<std::int64_t> step_blocks;
  auto start_step = [&](const ConnectorMetadata& meta) {
    Result<ConnectorMetadata> shipped = ConnectorMetadata::Decode(meta.Encode());
    for (auto& w : workers) w->StartLoadKv(*shipped);
  };
  const std::int64_t tpb = caches[0]->spec().tokens_per_block();

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
    } else if (cmd == "lw_step") {
      std::string id, transfer;
      std::int64_t first = 0, end = 0, prompt = 0;
      in >> id >> transfer >> first >> end >> prompt;
      KvTransferParams& params = lw_params[id];
      params.do_remote_decode = true;
      params.transfer_id = transfer;
      std::vector<std::int64_t> blocks;
      {
        std::lock_guard<std::mutex> lock(mu);
        std::vector<std::int64_t>& mine = allocated[id];
        while (static_cast<std::int64_t>(mine.size()) * tpb < end && !free_blocks.empty()) {
          const std::int64_t b = *free_blocks.begin();
          free_blocks.erase(free_blocks.begin());
          // Not yet computed: values no reader may take for the real ones.
          for (auto& c : caches) c->Fill(b, b + 1000003);
          mine.push_back(b);
        }
        blocks = mine;
      }
      step_blocks.clear();
      for (std::int64_t b = first / tpb; b < (end + tpb - 1) / tpb; ++b) {
        step_blocks.push_back(blocks[static_cast<std::size_t>(b)]);
      }
      scheduler.RequestScheduled(id, params, blocks, first, end - first, prompt);
      start_step(scheduler.BuildConnectorMeta());
      std::ostringstream ids;
      for (std::size_t i = 0; i < blocks.size(); ++i) ids << (i ? "," : "") << blocks[i];
      std::lock_guard<std::mutex> lock(mu);
      std::cout << "LWSTEP " << id << " " << ids.str() << std::endl;
    } else if (cmd == "lw_layer") {
      int layer = 0;
      in >> layer;
      for (std::size_t r = 0; r < caches.size(); ++r) {
        for (std::int64_t b : step_blocks) caches[r]->FillLayer(b, b, layer);
        Status s = workers[r]->SaveKvLayer(layer);
        if (!s.ok()) std::cerr << "SaveKvLayer: " << s.ToString() << "\n";
      }
      std::lock_guard<std::mutex> lock(mu);
      std::cout << "LAYER " << layer << std::endl;
    } else if (cmd == "lw_finish" || cmd == "lw_abort") {
      std::string id;
      in >> id;
      std::vector<std::int64_t> blocks;
      {
        std::lock_guard<std::mutex> lock(mu);
        blocks = allocated[id];
      }
      Scheduler::FinishedResult r = scheduler.RequestFinished(
          id, lw_params[id],
          cmd == "lw_finish" ? FinishReason::kLengthCapped : FinishReason::kAborted, blocks);
      lw_params.erase(id);
      start_step(scheduler.BuildConnectorMeta());
      std::lock_guard<std::mutex> lock(mu);
      if (r.delay_free) {
        std::cout << "HELD " << id << std::endl;
      } else {
        for (std::int64_t b : blocks) free_blocks.insert(b);
        allocated.erase(id);
        std::cout << "FREED " << id << std::endl;
      }
    } else if (cmd == "count") {
      std::string type;
      in >> type;
      std::uint64_t n = 0;
      for (auto& w : workers) {
        const WorkerStats st = w->Stats();
        auto it = st.notices_received.find(type);
        if (it != st.notices_received.end()) n += it->second;
      }
      std::lock_guard<std::mutex> lock(mu);
      std::cout << "COUNT " << type << " " << n << std::endl;
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
