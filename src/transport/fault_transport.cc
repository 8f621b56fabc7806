#include "transport/fault_transport.h"

#include <algorithm>
#include <thread>

namespace kvferry {

void FaultInjectingTransport::AddRule(FaultRule rule) {
  MutexLock lock(mu_);
  rules_.push_back(std::make_unique<FaultRule>(std::move(rule)));
}

std::uint64_t FaultInjectingTransport::faults_injected() const {
  MutexLock lock(mu_);
  return injected_;
}

bool FaultInjectingTransport::WaitFaultsInjected(std::uint64_t n, Deadline deadline) const {
  MutexLock lock(mu_);
  while (injected_ < n) {
    if (injected_cv_.WaitUntil(mu_, deadline)) return injected_ >= n;
  }
  return true;
}

Result<BatchId> FaultInjectingTransport::SubmitReads(PeerId peer, std::vector<ReadOp> ops,
                                                     Deadline deadline) {
  const FaultRule* rule = nullptr;
  {
    MutexLock lock(mu_);
    const std::uint64_t seq = seq_++;
    for (const auto& r : rules_) {
      if (r->match && r->match(seq, peer)) {
        rule = r.get();
        ++injected_;
        injected_cv_.SignalAll();
        break;
      }
    }
  }
  Entry e{std::nullopt, rule, Clock::now(), deadline, peer, false};
  if (rule == nullptr || rule->action != FaultRule::Action::kFail) {
    if (rule != nullptr && rule->action == FaultRule::Action::kCut) ops.resize(ops.size() / 2);
    if (rule != nullptr && rule->action == FaultRule::Action::kDelay) {
      e.ready_at = Clock::now() + rule->delay;
    }
    KVFERRY_ASSIGN_OR_RETURN(BatchId inner, inner_->SubmitReads(peer, std::move(ops), deadline));
    e.inner = inner;
  }
  MutexLock lock(mu_);
  const BatchId id = next_++;
  batches_[id] = e;
  return id;
}

BatchResult FaultInjectingTransport::Shape(const Entry& e, BatchResult r) const {
  if (e.rule == nullptr || r.state == BatchState::kInProgress) return r;
  switch (e.rule->action) {
    case FaultRule::Action::kFail:
      return {BatchState::kFailed, e.rule->status};
    case FaultRule::Action::kCut:
      if (r.state == BatchState::kDone) return {BatchState::kFailed, e.rule->status};
      return r;
    case FaultRule::Action::kHold:
      if (e.cancelled) return {BatchState::kCancelled, Status::Cancelled("held batch cancelled")};
      if (e.rule->gate && e.rule->gate->is_open()) return r;
      if (Clock::now() >= e.deadline) {
        return {BatchState::kFailed, Status::Timeout("held batch outlasted its deadline")};
      }
      return {};
    case FaultRule::Action::kDelay:
      if (Clock::now() < e.ready_at) {
        if (Clock::now() >= e.deadline) {
          return {BatchState::kFailed, Status::Timeout("injected delay outlasted the deadline")};
        }
        return {};
      }
      return r;
  }
  return r;
}

std::optional<FaultInjectingTransport::Entry> FaultInjectingTransport::Find(BatchId batch) const {
  MutexLock lock(mu_);
  auto it = batches_.find(batch);
  if (it == batches_.end()) return std::nullopt;
  return it->second;
}

BatchResult FaultInjectingTransport::Unknown(BatchId batch) {
  return {BatchState::kFailed, Status::NotFound("batch " + std::to_string(batch) + " is unknown")};
}

BatchResult FaultInjectingTransport::Poll(BatchId batch) {
  std::optional<Entry> e = Find(batch);
  if (!e) return Unknown(batch);
  if (!e->inner) return Shape(*e, {BatchState::kFailed, Status::Ok()});
  return Shape(*e, inner_->Poll(*e->inner));
}

BatchResult FaultInjectingTransport::Wait(BatchId batch, Deadline deadline) {
  std::optional<Entry> e = Find(batch);
  if (!e) return Unknown(batch);
  if (!e->inner) return Shape(*e, {BatchState::kFailed, Status::Ok()});
  BatchResult r = inner_->Wait(*e->inner, deadline);
  if (r.state == BatchState::kInProgress) return r;
  if (e->rule != nullptr && e->rule->action == FaultRule::Action::kHold) {
    // Held until the gate opens, the batch is cancelled, or a deadline passes.
    for (;;) {
      std::optional<Entry> now = Find(batch);
      if (!now) return Unknown(batch);
      BatchResult shaped = Shape(*now, r);
      if (shaped.state != BatchState::kInProgress || Clock::now() >= deadline) return shaped;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  // A delayed batch reports its end at ready_at, or fails at its deadline, whichever is first.
  const Clock::time_point until = std::min({e->ready_at, e->deadline, deadline});
  if (Clock::now() < until) std::this_thread::sleep_until(until);
  return Shape(*e, r);
}

void FaultInjectingTransport::Cancel(BatchId batch) {
  std::optional<BatchId> inner;
  {
    MutexLock lock(mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) return;
    inner = it->second.inner;
    it->second.cancelled = true;
  }
  if (inner) inner_->Cancel(*inner);
}

void FaultInjectingTransport::Disconnect(PeerId peer) {
  {
    MutexLock lock(mu_);
    ++disconnects_;
    for (auto& [id, e] : batches_) {
      if (e.peer == peer) e.cancelled = true;  // a held batch was running: it is cancelled
    }
  }
  inner_->Disconnect(peer);
}

std::uint64_t FaultInjectingTransport::disconnects() const {
  MutexLock lock(mu_);
  return disconnects_;
}

void FaultInjectingTransport::Release(BatchId batch) {
  std::optional<BatchId> inner;
  {
    MutexLock lock(mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) return;
    inner = it->second.inner;
    batches_.erase(it);
  }
  if (inner) inner_->Release(*inner);
}

}  // namespace kvferry
