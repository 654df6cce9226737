// safetensors: round trips in every dtype we train in, and each kind of corruption refused
// with a message naming the file (and tensor, where one is at fault).
#include "core/error.h"
#include "core/mapped_file.h"
#include "io/safetensors.h"
#include "scratch_dir.h"

#include <catch2/catch.hpp>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

using namespace fsdpp;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir() { return testing::scratch_dir("st"); }

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_all(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

// A file of `header` (JSON text) and `data` bytes, laid out as the format is.
void write_file(const fs::path& p, const std::string& header, size_t data_bytes) {
  const uint64_t length = header.size();
  write_all(p, std::string(reinterpret_cast<const char*>(&length), 8) + header + std::string(data_bytes, '\0'));
}

std::string error_of(const fs::path& p) {
  try {
    SafetensorsFile::open(p);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors round trip keeps names, shapes, dtypes and values", "[io]") {
  const auto path = temp_dir() / "round.safetensors";
  NamedTensors tensors = {{"a.weight", torch::randn({3, 5})},
                          {"b", torch::randn({7}).to(torch::kBFloat16)},
                          {"c.half", torch::randn({2, 2, 2}).to(torch::kHalf)},
                          {"ids", torch::arange(6, torch::kLong).view({2, 3})},
                          {"scalar", torch::tensor(3.5f).reshape({})}};
  std::ofstream(path.string() + ".tmp") << "mine";  // a file of the user's beside it: kept
  const mode_t umask = ::umask(027);  // the process's umask as it is when the file is written
  write_safetensors(path, tensors, {{"format", "pt"}});
  ::umask(umask);
  auto file = SafetensorsFile::open(path);
  CHECK(file->metadata().at("format") == "pt");
  REQUIRE(file->entries().size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    auto back = file->tensor(name);
    CHECK(back.scalar_type() == t.scalar_type());
    CHECK(torch::equal(back, t));
  }
  CHECK(read_text_file(path.string() + ".tmp") == "mine");
  CHECK((fs::status(path).permissions() & fs::perms::all) == static_cast<fs::perms>(0640));
  for (const auto& entry : fs::directory_iterator(path.parent_path())) {
    CHECK_FALSE(entry.path().filename().string().starts_with("round.safetensors.tmp-"));  // no temporary file left
  }
}

TEST_CASE("corrupt safetensors files are refused naming the file", "[io]") {
  const auto dir = temp_dir();
  const auto good = dir / "good.safetensors";
  write_safetensors(good, {{"w", torch::randn({4, 4})}, {"v", torch::randn({4})}});
  const std::string bytes = read_all(good);

  const auto bad = dir / "bad.safetensors";
  SECTION("shorter than the length prefix") {
    write_all(bad, bytes.substr(0, 5));
    CHECK_THAT(error_of(bad), Catch::Contains(bad.string()) && Catch::Contains("shorter"));
  }
  SECTION("header length beyond the file") {
    std::string b = bytes;
    b[6] = '\x7f';
    write_all(bad, b);
    CHECK_THAT(error_of(bad), Catch::Contains(bad.string()) && Catch::Contains("header"));
  }
  SECTION("header not JSON") {
    std::string b = bytes;
    b[8] = '#';
    write_all(bad, b);
    CHECK_THAT(error_of(bad), Catch::Contains(bad.string()) && Catch::Contains("not valid JSON"));
  }
  SECTION("truncated data") {
    write_all(bad, bytes.substr(0, bytes.size() - 3));
    CHECK_THAT(error_of(bad), Catch::Contains(bad.string()) && Catch::Contains("past the end"));
  }
  SECTION("unknown dtype") {
    std::string b = bytes;
    auto pos = b.find("\"F32\"");
    b.replace(pos, 5, "\"Q32\"");
    write_all(bad, b);
    CHECK_THAT(error_of(bad), Catch::Contains("unsupported dtype 'Q32'"));
  }
  SECTION("bytes after the last tensor") {
    write_all(bad, bytes + "junk");
    CHECK_THAT(error_of(bad), Catch::Contains(bad.string()) && Catch::EndsWith("(4 bytes after the last tensor's data)"));
  }
  SECTION("bytes between two tensors") {
    write_file(bad, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12);
    CHECK_THAT(error_of(bad), Catch::EndsWith("(bytes 4..8 of the data section belong to no tensor)"));
  }
  SECTION("overlapping tensors") {
    write_file(bad, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8);
    CHECK_THAT(error_of(bad), Catch::EndsWith("(tensor byte ranges overlap)"));
  }
  SECTION("a tensor named twice") {
    write_file(bad, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8);
    CHECK_THAT(error_of(bad), Catch::Contains(bad.string()) && Catch::EndsWith("key \"a\" appears twice in one object"));
  }
  SECTION("missing file") {
    CHECK_THAT(error_of(dir / "absent.safetensors"), Catch::Contains("absent.safetensors"));
  }
  SECTION("missing tensor") {
    auto file = SafetensorsFile::open(good);
    CHECK_THROWS_WITH(file->tensor("nope"), Catch::Contains("missing tensor 'nope'"));
  }
}
