// IpcHandle's encoding and OpenDevice's table of implementations.
#include "device/device.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "device/acl/acl_device.h"
#include "device/cuda/cuda_device.h"
#include "device/sim/sim_device.h"

namespace kvferry::device {
namespace {

constexpr char kMagic[4] = {'K', 'V', 'D', 'H'};
constexpr std::uint8_t kVersion = 1;
constexpr std::size_t kMaxOpaque = 4096;

template <typename T>
void Put(std::vector<std::uint8_t>& out, T v) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}

// Reads from a span, never past its end.
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> bytes) : bytes_(bytes) {}
  template <typename T>
  bool Get(T& v) {
    if (bytes_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  bool GetBytes(std::size_t n, std::vector<std::uint8_t>& out) {
    if (bytes_.size() - pos_ < n) return false;
    out.assign(bytes_.begin() + static_cast<std::ptrdiff_t>(pos_),
               bytes_.begin() + static_cast<std::ptrdiff_t>(pos_ + n));
    pos_ += n;
    return true;
  }
  bool AtEnd() const { return pos_ == bytes_.size(); }

 private:
  std::span<const std::uint8_t> bytes_;
  std::size_t pos_ = 0;
};

}  // namespace

std::vector<std::uint8_t> IpcHandle::Encode() const {
  std::vector<std::uint8_t> out(kMagic, kMagic + sizeof(kMagic));
  Put<std::uint8_t>(out, kVersion);
  Put<std::uint8_t>(out, static_cast<std::uint8_t>(kind.size()));
  out.insert(out.end(), kind.begin(), kind.end());
  Put<std::int32_t>(out, device_index);
  Put<std::uint64_t>(out, alloc_size);
  Put<std::uint64_t>(out, offset);
  Put<std::uint32_t>(out, static_cast<std::uint32_t>(opaque.size()));
  out.insert(out.end(), opaque.begin(), opaque.end());
  return out;
}

Result<IpcHandle> IpcHandle::Decode(std::span<const std::uint8_t> bytes) {
  const auto bad = [&](const char* what) {
    return Status::InvalidArgument(std::string("device IPC handle: expected ") + what +
                                   " (format KVDH version 1); found " +
                                   std::to_string(bytes.size()) +
                                   " bytes that do not parse: was it made by IpcHandle::Encode?");
  };
  Reader r(bytes);
  std::vector<std::uint8_t> magic;
  if (!r.GetBytes(sizeof(kMagic), magic) ||
      std::memcmp(magic.data(), kMagic, sizeof(kMagic)) != 0) {
    return bad("the magic \"KVDH\"");
  }
  std::uint8_t version = 0;
  std::uint8_t kind_len = 0;
  if (!r.Get(version) || version != kVersion) return bad("version 1");
  std::vector<std::uint8_t> kind;
  if (!r.Get(kind_len) || kind_len == 0 || !r.GetBytes(kind_len, kind)) return bad("a kind");
  IpcHandle h;
  h.kind.assign(kind.begin(), kind.end());
  std::int32_t index = 0;
  std::uint32_t opaque_len = 0;
  if (!r.Get(index) || index < 0) return bad("a non-negative device index");
  h.device_index = index;
  if (!r.Get(h.alloc_size) || !r.Get(h.offset) || h.offset >= h.alloc_size) {
    return bad("an allocation size and an offset inside it");
  }
  if (!r.Get(opaque_len) || opaque_len > kMaxOpaque || !r.GetBytes(opaque_len, h.opaque)) {
    return bad("at most 4096 implementation bytes");
  }
  if (!r.AtEnd()) return bad("nothing after the implementation bytes");
  return h;
}

Status PollEventUntil(Event& event, Deadline deadline, std::string_view what) {
  auto pause = std::chrono::microseconds(5);
  for (;;) {
    EventPoll p = event.Poll();
    if (p.state == EventState::kComplete) return Status::Ok();
    if (p.state == EventState::kFailed) return p.status;
    if (Clock::now() >= deadline) {
      return Status::Timeout(std::string(what) +
                             ": the copies before it had not finished by the deadline");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - Clock::now()));
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(1));
  }
}

bool KnownDeviceType(std::string_view type) {
  return type == "sim" || type == "cuda" || type == "npu";
}

Result<std::unique_ptr<Device>> OpenDevice(std::string_view name) {
  const auto colon = name.find(':');
  int index = -1;
  if (colon != std::string_view::npos) {
    const std::string_view digits = name.substr(colon + 1);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
    if (ec != std::errc() || end != digits.data() + digits.size() || index < 0) index = -1;
  }
  if (index < 0) {
    return Status::InvalidArgument(
        "device name: expected <kind>:<index> such as sim:0, cuda:0 or npu:0; "
        "found \"" +
        std::string(name) + "\"");
  }
  const std::string_view kind = name.substr(0, colon);
  // One branch per implementation folder (docs/device.md).
  if (kind == "sim") {
    KVFERRY_ASSIGN_OR_RETURN(auto dev, SimDevice::Create(SimOptions{.index = index}));
    return std::unique_ptr<Device>(std::move(dev));
  }
  if (kind == "cuda") {
    KVFERRY_ASSIGN_OR_RETURN(auto dev, CudaDevice::Open(index));
    return std::unique_ptr<Device>(std::move(dev));
  }
  if (kind == "npu") {
    KVFERRY_ASSIGN_OR_RETURN(auto dev, AclDevice::Open(index));
    return std::unique_ptr<Device>(std::move(dev));
  }
  return Status::InvalidArgument("device name \"" + std::string(name) +
                                 "\": unknown kind; this build has sim, cuda and npu");
}

Result<Device*> ProcessDevice(std::string_view name) {
  // Never destroyed: transports and caches of any lifetime (statics included) may use them.
  static auto* mu = new std::mutex;
  static auto* devices = new std::map<std::string, std::unique_ptr<Device>, std::less<>>;
  std::lock_guard<std::mutex> lock(*mu);
  auto it = devices->find(name);
  if (it != devices->end()) return it->second.get();
  KVFERRY_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, OpenDevice(name));
  Device* raw = device.get();
  devices->emplace(std::string(name), std::move(device));
  return raw;
}

}  // namespace kvferry::device
