#include "kvferry/rank_table.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

namespace kvferry {
namespace {

using ::testing::HasSubstr;

std::string DataPath(const std::string& name) {
  return std::string(KVFERRY_TEST_DATA_DIR) + "/" + name;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One valid table as text, for the malformed variants below.
std::string ValidText() {
  return R"({"version": "1.2", "server_count": "1",
    "prefill_device_list": [
      {"server_id": "127.0.0.1", "device_id": "0", "device_ip": "127.0.0.1", "cluster_id": "1"}],
    "decode_device_list": [
      {"server_id": "127.0.0.1", "device_id": "1", "device_ip": "127.0.0.1", "cluster_id": "2"}],
    "status": "completed"})";
}

std::string Replace(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

Status ParseError(const std::string& text) {
  Result<RankTable> t = RankTable::Parse(text, "table.json");
  EXPECT_FALSE(t.ok());
  return t.status();
}

TEST(RankTableTest, LoadsA2TableAsTheGeneratorWritesIt) {
  Result<RankTable> t = RankTable::Load(DataPath("ranktable_a2.json"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->version(), "1.2");
  EXPECT_EQ(t->status(), "completed");
  EXPECT_EQ(t->server_count(), "2");
  ASSERT_EQ(t->prefill().size(), 2u);
  ASSERT_EQ(t->decode().size(), 2u);
  EXPECT_EQ(t->decode()[1].device_ip, "198.51.100.10");
  EXPECT_EQ(t->decode()[1].cluster_id, 4u);
  EXPECT_FALSE(t->prefill()[0].super_pod_id.has_value());
}

TEST(RankTableTest, LoadsA3TableWithSuperPodFields) {
  Result<RankTable> t = RankTable::Load(DataPath("ranktable_a3.json"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->prefill()[1].super_pod_id, "0");
  EXPECT_EQ(t->prefill()[1].super_device_id, "104857601");
}

TEST(RankTableTest, AcceptsIntegersWhereTheGeneratorWritesStrings) {
  Result<RankTable> t = RankTable::Load(DataPath("ranktable_integers.json"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->prefill()[0].device_id, "0");
  EXPECT_EQ(t->prefill()[0].super_device_id, "7");
  EXPECT_EQ(t->decode()[0].cluster_id, 2u);
  EXPECT_EQ(t->server_count(), "1");
}

TEST(RankTableTest, WritesTheGeneratorFormatAndReadsItBack) {
  Result<RankTable> t = RankTable::Load(DataPath("ranktable_a3.json"));
  ASSERT_TRUE(t.ok());
  // Same keys, order and indentation as the reference generator's json.dump(indent=4).
  EXPECT_EQ(t->ToJson(), ReadFile(DataPath("ranktable_a3.json")));
  Result<RankTable> again = RankTable::Parse(t->ToJson(), "round trip");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->prefill(), t->prefill());
  EXPECT_EQ(again->decode(), t->decode());
}

TEST(RankTableTest, SyntaxErrorNamesTheFileAndPosition) {
  Status s = ParseError("{\"prefill_device_list\": [}");
  EXPECT_THAT(s.message(), HasSubstr("table.json: not valid JSON: byte "));
}

TEST(RankTableTest, MissingFileIsNotFound) {
  Result<RankTable> t = RankTable::Load("/nonexistent/ranktable.json");
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr("DISAGGREGATED_PREFILL_RANK_TABLE_PATH"));
}

TEST(RankTableTest, ErrorsNameTheListIndexAndField) {
  EXPECT_THAT(ParseError("[]").message(), HasSubstr("expected a JSON object, found an array"));
  EXPECT_THAT(
      ParseError(Replace(ValidText(), "\"decode_device_list\"", "\"decode_devices\"")).message(),
      HasSubstr("table.json: decode_device_list: missing"));
  EXPECT_THAT(ParseError(R"({"prefill_device_list": {}, "decode_device_list": []})").message(),
              HasSubstr("table.json: prefill_device_list: expected an array, found an object"));
  EXPECT_THAT(ParseError(Replace(ValidText(), "\"device_ip\": \"127.0.0.1\", \"cluster_id\": \"2\"",
                                 "\"cluster_id\": \"2\""))
                  .message(),
              HasSubstr("table.json: decode_device_list[0].device_ip: missing"));
  EXPECT_THAT(ParseError(Replace(ValidText(), "\"cluster_id\": \"1\"", "\"cluster_id\": \"one\""))
                  .message(),
              HasSubstr("prefill_device_list[0].cluster_id: expected a non-negative integer"));
  EXPECT_THAT(
      ParseError(Replace(ValidText(), "\"cluster_id\": \"1\"", "\"cluster_id\": -1")).message(),
      HasSubstr("prefill_device_list[0].cluster_id: expected a string or a non-negative "
                "integer, found an integer"));
  EXPECT_THAT(
      ParseError(Replace(ValidText(), "\"device_id\": \"0\"", "\"device_id\": [0]")).message(),
      HasSubstr("prefill_device_list[0].device_id: expected a string or a non-negative "
                "integer, found an array"));
  EXPECT_THAT(ParseError(Replace(ValidText(), "\"server_id\": \"127.0.0.1\"", "\"server_id\": 5"))
                  .message(),
              HasSubstr("prefill_device_list[0].server_id: expected a string, found an integer"));
  EXPECT_THAT(ParseError(Replace(ValidText(), "\"device_ip\": \"127.0.0.1\"",
                                 "\"device_ip\": \"127.0.0.300\""))
                  .message(),
              HasSubstr("prefill_device_list[0].device_ip: expected an IPv4 or IPv6 address, "
                        "found \"127.0.0.300\""));
  EXPECT_THAT(ParseError(Replace(ValidText(), "\"server_id\": \"127.0.0.1\"",
                                 "\"server_id\": \"host one\""))
                  .message(),
              HasSubstr("prefill_device_list[0].server_id: expected a host address or name"));
  EXPECT_THAT(
      ParseError(Replace(ValidText(), "\"status\": \"completed\"", "\"status\": \"initializing\""))
          .message(),
      HasSubstr("status: is \"initializing\"; expected \"completed\""));
  EXPECT_THAT(ParseError(Replace(ValidText(), "\"server_count\": \"1\"", "\"server_count\": \"0\""))
                  .message(),
              HasSubstr("server_count: expected a positive integer"));
  EXPECT_THAT(
      ParseError(Replace(ValidText(), "\"version\": \"1.2\"", "\"version\": [1]")).message(),
      HasSubstr("version: expected a string, found an array"));
  EXPECT_THAT(ParseError(Replace(ValidText(), "{\"server_id\": \"127.0.0.1\", \"device_id\": \"0\"",
                                 "[], {\"server_id\": \"127.0.0.1\", \"device_id\": \"0\""))
                  .message(),
              HasSubstr("prefill_device_list[0]: expected an object, found an array"));
}

TEST(RankTableTest, RejectsDuplicateClusterIdsAndDevices) {
  EXPECT_THAT(
      ParseError(Replace(ValidText(), "\"cluster_id\": \"2\"", "\"cluster_id\": 1")).message(),
      HasSubstr("decode_device_list[0].cluster_id: cluster id 1 is already used by "
                "prefill_device_list[0]"));
  EXPECT_THAT(
      ParseError(Replace(ValidText(), "\"device_id\": \"1\"", "\"device_id\": \"0\"")).message(),
      HasSubstr("decode_device_list[0]: device \"0\" of server \"127.0.0.1\" is already "
                "listed as prefill_device_list[0]"));
}

TEST(RankTableTest, RejectsTwoEmptyLists) {
  EXPECT_THAT(ParseError(R"({"prefill_device_list": [], "decode_device_list": []})").message(),
              HasSubstr("both device lists are empty"));
}

TEST(RankTableTest, SelectsByServerVisibleDevicesAndTpRank) {
  Result<RankTable> t = RankTable::Load(DataPath("ranktable_a3.json"));
  ASSERT_TRUE(t.ok());
  Result<DeviceEntry> e = t->SelectLocal(Role::kDecode, "192.0.2.20", {}, 1);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->device_id, "3");
  // With visible devices 3 only, TP rank 0 is device 3.
  e = t->SelectLocal(Role::kDecode, "192.0.2.20", ParseVisibleDevices("3"), 0);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->cluster_id, 4u);
  e = t->SelectLocal(Role::kPrefill, "192.0.2.20", {}, 0);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->device_id, "0");
}

TEST(RankTableTest, NotFoundNamesWhatWasSoughtAndWhatTheTableHolds) {
  Result<RankTable> t = RankTable::Load(DataPath("ranktable_a2.json"));
  ASSERT_TRUE(t.ok());
  Result<DeviceEntry> e =
      t->SelectLocal(Role::kDecode, "192.0.2.11", ParseVisibleDevices("1, 5"), 1);
  ASSERT_EQ(e.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(e.status().message(),
              HasSubstr("no decode_device_list entry for TP rank 1 on server_id \"192.0.2.11\" "
                        "with visible devices [1,5]: 1 entries match (device ids 1)"));
  EXPECT_THAT(e.status().message(), HasSubstr("holds 2 entries on 192.0.2.11 (2)"));
  e = t->SelectLocal(Role::kPrefill, "192.0.2.99", {}, 0);
  EXPECT_THAT(e.status().message(), HasSubstr("0 entries match"));
  EXPECT_THAT(e.status().message(), HasSubstr("192.0.2.10 (2)"));
}

TEST(RankTableTest, ParseRoleAcceptsVllmNamesOnly) {
  EXPECT_EQ(*ParseRole("kv_producer"), Role::kPrefill);
  EXPECT_EQ(*ParseRole("kv_consumer"), Role::kDecode);
  EXPECT_EQ(*ParseRole("kv_both"), Role::kBoth);
  EXPECT_STREQ(RoleName(Role::kBoth), "both");
  EXPECT_THAT(ParseRole("kv_mixed").status().message(), HasSubstr("expected kv_producer"));
}

TEST(RankTableTest, VisibleDevicesParsing) {
  EXPECT_TRUE(ParseVisibleDevices("").empty());
  EXPECT_EQ(ParseVisibleDevices(" 0, 1,,2 "), (std::vector<std::string>{"0", "1", "2"}));
}

TEST(GenerateRankTableTest, WritesPrefillThenDecodeWithClusterIdsFromOne) {
  RankTableGenOptions o;
  o.hosts = {"127.0.0.1", "127.0.0.2"};
  o.devices_per_host = 4;
  o.prefill_count = 4;
  o.decode_count = 2;
  o.super_pod = true;
  Result<RankTable> t = GenerateRankTable(o);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->prefill().size(), 4u);
  ASSERT_EQ(t->decode().size(), 2u);
  EXPECT_EQ(t->prefill()[3].cluster_id, 4u);
  EXPECT_EQ(t->decode()[0].server_id, "127.0.0.2");
  EXPECT_EQ(t->decode()[1].device_id, "1");
  EXPECT_EQ(t->decode()[1].super_device_id, "5");
  EXPECT_EQ(t->server_count(), "2");
  Result<RankTable> back = RankTable::Parse(t->ToJson(), "gen");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->decode(), t->decode());
}

TEST(GenerateRankTableTest, RefusesMoreDevicesThanHostsHave) {
  RankTableGenOptions o;
  o.hosts = {"127.0.0.1"};
  o.devices_per_host = 2;
  o.prefill_count = 2;
  o.decode_count = 1;
  EXPECT_THAT(GenerateRankTable(o).status().message(), HasSubstr("exceed the 2 devices"));
  o.decode_count = 0;
  o.device_ips = {"a", "b"};
  EXPECT_THAT(GenerateRankTable(o).status().message(), HasSubstr("one device ip per host"));
  o.device_ips = {"not-an-ip"};
  EXPECT_THAT(GenerateRankTable(o).status().message(), HasSubstr("IPv4 or IPv6"));
}

}  // namespace
}  // namespace kvferry
