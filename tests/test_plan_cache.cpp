#include "testing.h"

#include <train/files.h>
#include <fstream>
#include <iterator>
#include <train/plan_cache.h>

#include "comma_locale.h"

using namespace train;

namespace {
PlanCacheKey key_for(const std::string& device) {
  PlanCacheKey k;
  k.add("device", device);
  k.add("model", "11689512 params");
  k.add("precision", "bf16");
  return k;
}
}  // namespace

TEST_CASE("plan cache: miss, store, hit, and what changed", "[plan][cache]") {
  const std::string dir = files::make_temp_directory("train_plan_cache_");
  PlanCache cache(dir);
  const PlanCacheKey a100 = key_for("NVIDIA A100-SXM4-80GB");
  CHECK_FALSE(cache.find(a100).has_value());
  CHECK(cache.changes(a100, "run.yaml").empty());

  MemoryEvidence m;
  m.fixed_bytes = 123456789;
  m.per_sample_bytes = 0.1 + 38.0 * (1 << 20);
  m.budget_bytes = int64_t{72} << 30;
  m.max_micro_batch = 1900;
  m.source = "probe on cuda:0 at 8, 16, 32";
  m.throughput = {{16, 1000.5}, {32, 1800.25}};
  m.throughput_choice = 32;
  m.slope_known_up_to = 64;
  cache.store(a100, m, "run.yaml");

  const auto hit = PlanCache(dir).find(a100);
  REQUIRE(hit.has_value());
  CHECK(hit->fixed_bytes == m.fixed_bytes);
  CHECK(hit->per_sample_bytes == m.per_sample_bytes);  // exact round trip
  CHECK(hit->max_micro_batch == 1900);
  CHECK(hit->throughput == m.throughput);
  CHECK(hit->throughput_choice == 32);
  CHECK(hit->slope_known_up_to == 64);
  CHECK(hit->source == "probe on cuda:0 at 8, 16, 32");

  const PlanCacheKey h100 = key_for("NVIDIA H100 80GB HBM3");
  CHECK_FALSE(cache.find(h100).has_value());
  const auto changed = cache.changes(h100, "run.yaml");
  REQUIRE(changed.size() == 1);
  CHECK(changed[0] == "device: NVIDIA A100-SXM4-80GB -> NVIDIA H100 80GB HBM3");
  CHECK(cache.changes(h100, "other.yaml").empty());

  // A damaged entry is a miss, not an error.
  std::ofstream(files::join(dir, a100.hash() + ".json")) << "{not json";
  CHECK_FALSE(cache.find(a100).has_value());
  files::remove_all(dir);
}

TEST_CASE("plan cache: an entry round-trips under a comma-decimal global C++ locale", "[plan][cache]") {
  const std::string dir = files::make_temp_directory("train_plan_cache_");
  testing::CommaDecimalLocale comma;
  REQUIRE(comma.sample() == "12.345,5");  // a stream made now would write that
  PlanCache cache(dir);
  const PlanCacheKey key = key_for("NVIDIA A100-SXM4-80GB");
  MemoryEvidence m;
  m.fixed_bytes = 123456789;
  m.per_sample_bytes = 0.1 + 38.0 * (1 << 20);
  m.budget_bytes = int64_t{72} << 30;
  m.max_micro_batch = 1900;
  m.source = "probe";
  m.throughput = {{16, 1000.5}};
  m.throughput_choice = 16;
  cache.store(key, m, "run.yaml");
  std::ifstream in(files::join(dir, key.hash() + ".json"));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CHECK_THAT(text, Catch::Contains("\"per_sample_bytes\":39845888.100000001"));
  const auto hit = cache.find(key);  // yaml-cpp's own number reading would fail on "1000.5" here
  REQUIRE(hit.has_value());
  CHECK(hit->per_sample_bytes == m.per_sample_bytes);
  CHECK(hit->throughput == m.throughput);
  files::remove_all(dir);
}

TEST_CASE("plan cache: an ill-typed or unreadable entry is a miss with a warning, never an error", "[plan][cache]") {
  const std::string dir = files::make_temp_directory("train_plan_cache_");
  PlanCache cache(dir);
  const PlanCacheKey key = key_for("NVIDIA A100-SXM4-80GB");
  MemoryEvidence m;
  m.max_micro_batch = 64;
  m.source = "probe";
  cache.store(key, m, "run.yaml");
  REQUIRE(cache.find(key).has_value());
  const std::string entry = files::join(dir, key.hash() + ".json");
  std::string latest;
  for (const std::string& name : files::list_directory(dir)) {
    if (name.rfind("latest-", 0) == 0) latest = files::join(dir, name);
  }
  REQUIRE_FALSE(latest.empty());

  // Valid JSON with the wrong types: yaml-cpp's bad conversions used to escape find() and
  // changes() and stop every `train fit` until the file was deleted.
  for (const std::string& text :
       {std::string("{\"format\":3,\"key\":{\"device\":[\"x\"]},\"evidence\":{}}"),
        std::string("{\"format\":3,\"key\":{\"device\":\"NVIDIA A100-SXM4-80GB\",\"model\":\"11689512 params\","
                    "\"precision\":\"bf16\"},\"evidence\":{\"fixed_bytes\":[1],\"per_sample_bytes\":1}}"),
        std::string("{\"format\":[3]}"), std::string("[1, 2]"), std::string("\"just a string\"")}) {
    INFO(text);
    std::ofstream(entry) << text;
    CHECK_FALSE(cache.find(key).has_value());
  }
  for (const std::string& text : {std::string("{\"device\":[\"x\"]}"), std::string("[1]"), std::string("{oops")}) {
    INFO(text);
    std::ofstream(latest) << text;
    CHECK_NOTHROW(cache.changes(key, "run.yaml"));
  }
  // The next store overwrites the damaged entries.
  cache.store(key, m, "run.yaml");
  CHECK(cache.find(key).has_value());
  CHECK(cache.changes(key, "run.yaml").empty());
  files::remove_all(dir);
}
