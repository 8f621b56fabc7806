// A worker's KV cache groups (vLLM's KVCacheConfig): validation and the compatibility hash over
// every group.
#include "common/digest.h"
#include "kvferry/cache_spec.h"

namespace kvferry {

CacheGroups::CacheGroups(CacheSpec one) { groups_.push_back(std::move(one)); }

Result<CacheGroups> CacheGroups::Create(std::vector<CacheSpec> groups) {
  if (groups.empty() || groups.size() > static_cast<std::size_t>(kMaxCacheGroups)) {
    return Status::InvalidArgument("a cache of " + std::to_string(groups.size()) +
                                   " KV cache groups; expected 1 to " +
                                   std::to_string(kMaxCacheGroups));
  }
  for (std::size_t g = 1; g < groups.size(); ++g) {
    if (groups[g].tp_size() != groups[0].tp_size() || groups[g].tp_rank() != groups[0].tp_rank()) {
      return Status::InvalidArgument(
          "KV cache group " + std::to_string(g) + " is for TP rank " +
          std::to_string(groups[g].tp_rank()) + " of " + std::to_string(groups[g].tp_size()) +
          " but group 0 for rank " + std::to_string(groups[0].tp_rank()) + " of " +
          std::to_string(groups[0].tp_size()) + "; every group of a worker's cache is its rank's");
    }
  }
  return CacheGroups(std::move(groups));
}

std::string CacheGroups::CanonicalText() const {
  if (groups_.size() == 1) return groups_[0].CanonicalText();
  std::string out = "kvferry-groups-v2 n=" + std::to_string(groups_.size());
  for (const CacheSpec& g : groups_) out += " | " + g.CanonicalText();
  return out;
}

CompatibilityHash CacheGroups::Hash() const {
  if (groups_.size() == 1) return groups_[0].Hash();
  return Sha256(CanonicalText());
}

std::int64_t CacheGroups::TotalBytes() const {
  std::int64_t total = 0;
  for (const CacheSpec& g : groups_) total += g.TotalBytes();  // each bounded; 16 groups
  return total;
}

namespace {

std::vector<std::string> Words(const std::string& text) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = std::min(text.find(' ', at), text.size());
    out.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  return out;
}

}  // namespace

std::string FirstDifference(const CacheGroups& ours, const CacheGroups& theirs) {
  if (ours.Hash() == theirs.Hash()) return "";
  std::string first;
  if (ours.size() != theirs.size()) {
    first = std::to_string(ours.size()) + " KV cache group(s) here, " +
            std::to_string(theirs.size()) + " there";
  } else {
    for (int g = 0; g < ours.size() && first.empty(); ++g) {
      const std::vector<std::string> a = Words(ours[g].CanonicalText());
      const std::vector<std::string> b = Words(theirs[g].CanonicalText());
      for (std::size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
        const std::string x = i < a.size() ? a[i] : "(nothing)";
        const std::string y = i < b.size() ? b[i] : "(nothing)";
        if (x == y) continue;
        first = (ours.size() > 1 ? "KV cache group " + std::to_string(g) + ": " : std::string()) +
                x + " here, " + y + " there";
        break;
      }
    }
  }
  return "first difference: " + first + " (this side: " + ours.CanonicalText() +
         "; the other: " + theirs.CanonicalText() + ")";
}

}  // namespace kvferry
