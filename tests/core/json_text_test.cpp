// parse_json's bounds: a value nested too deep and a text too large to parse are each one
// UserError naming the file, and neither is built.
#include "core/error.h"
#include "core/json_text.h"
#include "core/mapped_file.h"
#include "scratch_dir.h"

#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

using namespace fsdpp;

TEST_CASE("parse_json refuses a value nested too deep and a text past its size bound", "[core]") {
  CHECK(parse_json("{\"a\": [1, {\"b\": 2}]}", "ok.json")["a"][1]["b"] == 2);
  const std::string deep = std::string(kMaxJsonDepth + 2, '[') + std::string(kMaxJsonDepth + 2, ']');  // 66 levels
  CHECK_THROWS_WITH(parse_json(deep, "deep.json"), "deep.json: nested deeper than 64 levels");
  CHECK_THROWS_WITH(parse_json("{\"a\": }", "bad.json"), Catch::StartsWith("bad.json: not valid JSON ("));
  // A key twice in one object is refused at any depth; the same key in two objects is not.
  CHECK_THROWS_WITH(parse_json(R"({"a": 1, "b": [{"c": 1, "c": 2}]})", "twice.json"),
                    "twice.json: key \"c\" appears twice in one object");
  CHECK_THROWS_WITH(parse_json(R"({"a": {"c": 1}, "a": 2})", "twice.json"), "twice.json: key \"a\" appears twice in one object");
  CHECK(parse_json(R"([{"c": 1}, {"c": 2, "d": {"c": 3}}])", "ok.json")[1]["d"]["c"] == 3);
  // A sparse file one byte past the bound, mapped: refused before a byte of it is read, where
  // parsing it would take some twenty times its size.
  const auto path = testing::scratch_dir("json_text") / "config.json";
  { std::ofstream(path).put('{'); }
  std::filesystem::resize_file(path, kMaxJsonBytes + 1);
  const auto mapped = MappedFile::open(path);
  const std::string_view text(reinterpret_cast<const char*>(mapped->data()), mapped->size());
  CHECK_THROWS_WITH(parse_json(text, path.string()),
                    path.string() + ": 1073741825 bytes of JSON, more than the 1024 MiB any file fsdpp reads holds");
  CHECK(mapped->resident_bytes() <= 64 * 4096);  // the first page or so: its bytes were never read
}
