// What a worker answers on its side channel (docs/protocol.md): metadata requests, and on the
// prefill side layer-wise subscriptions, finished and abort notices and lease renewals, which act
// on its holds (DESIGN rules 10 and 13); on the decode side, layer-wise progress pushes.
#include "common/log.h"
#include "connector/worker_impl.h"
#include "layout/tp_map.h"

namespace kvferry {

wire::Message WorkerImpl::Handle(const wire::Message& request) {
  if (const auto* p = std::get_if<wire::Progress>(&request)) {
    {
      MutexLock lock(mu_);
      ++notices_received_[wire::MessageTypeName(request)];
    }
    if (!ReadsKv(cfg_.role)) {
      return wire::ErrorReply{StatusCode::kInvalidArgument,
                              "a prefill worker takes no 'progress' messages"};
    }
    return loads_->OnProgress(*p);  // outside mu_: the load runner has its own locks
  }
  std::vector<ProgressPush> pushes;
  wire::Message reply;
  {
    MutexLock lock(mu_);
    reply = HandleLocked(request, pushes);
  }
  if (!pushes.empty()) pusher_->Push(std::move(pushes));
  return reply;
}

wire::Message WorkerImpl::HandleLocked(const wire::Message& request,
                                       std::vector<ProgressPush>& pushes) {
  ++notices_received_[wire::MessageTypeName(request)];
  if (std::holds_alternative<wire::MetadataRequest>(request)) {
    if (!metadata_) {
      return wire::ErrorReply{StatusCode::kUnavailable,
                              "this worker has not registered its KV caches yet; retry shortly"};
    }
    return *metadata_;
  }
  if (!ServesKv(cfg_.role)) {
    return wire::ErrorReply{StatusCode::kInvalidArgument,
                            std::string("a decode worker does not take '") +
                                wire::MessageTypeName(request) + "' messages"};
  }
  const Clock::time_point now = Clock::now();
  if (const auto* sub = std::get_if<wire::Subscribe>(&request)) {
    if (!layerwise_) {
      return wire::ErrorReply{StatusCode::kUnavailable,
                              "this worker has not registered its KV caches yet; retry shortly"};
    }
    pushes = layerwise_->Expire(now);
    Result<wire::Progress> progress = layerwise_->Subscribe(*sub, now);
    if (!progress.ok()) {
      return wire::ErrorReply{progress.status().code(), std::string(progress.status().message())};
    }
    return *progress;
  }
  Result<std::uint32_t> count = std::uint32_t{0};
  if (const auto* f = std::get_if<wire::FinishedNotice>(&request)) {
    count = holds_.Finished(ReaderKey(f->from), f->tp_size, f->request_ids, now, f->pp_readers);
  } else if (const auto* a = std::get_if<wire::AbortNotice>(&request)) {
    Log().info("abort notice from {} for {} request(s), first {}: {}", ReaderKey(a->from),
               a->request_ids.size(), a->request_ids.empty() ? "-" : a->request_ids.front(),
               a->reason);
    count = holds_.Aborted(a->request_ids, now);
    if (layerwise_) {
      for (const std::string& id : a->request_ids) layerwise_->Unsubscribe(id, ReaderKey(a->from));
    }
  } else if (const auto* l = std::get_if<wire::LeaseRenewal>(&request)) {
    // Clamped to this worker's own lease: no peer can pin blocks for longer.
    count = holds_.Renew(l->request_ids, std::chrono::milliseconds(l->lease_ms), now);
  }
  if (!count.ok())
    return wire::ErrorReply{count.status().code(), std::string(count.status().message())};
  return wire::Ack{*count};
}

int WorkerImpl::ExpectedReadersLocked(std::uint32_t reader_tp) const {
  if (!caches_) return 1;
  // Readers follow group 0's head split; LoadRunner::Plan refuses groups whose TP plans name
  // other ranks, so every group is read by the same decode ranks.
  Result<int> n =
      ExpectedReaders((*caches_)[0], cfg_.tp_size, static_cast<int>(reader_tp), cfg_.tp_rank);
  if (!n.ok()) {
    Log().warn("cannot count readers for decode TP {}: {}; waiting for one", reader_tp,
               n.status().ToString());
    return 1;
  }
  return *n;
}

}  // namespace kvferry
