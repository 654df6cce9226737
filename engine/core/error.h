// Errors a user can fix (bad config, missing file, corrupt checkpoint). The CLI prints them
// as one line and exits with status 2; anything else escaping is an engine bug.
#pragma once

#include <algorithm>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace fsdpp {

// The length of the well-formed UTF-8 sequence that starts at text[at] (no overlong form,
// surrogate or code point past U+10FFFF), or 0 where none does.
inline size_t utf8_sequence(const std::string& text, size_t at) {
  const auto byte = [&](size_t i) { return i < text.size() ? static_cast<unsigned char>(text[i]) : 0; };
  const unsigned char lead = byte(at);
  size_t length = 0;
  unsigned char low = 0x80, high = 0xBF;  // the second byte's range
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) low = 0xA0;
    if (lead == 0xED) high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) low = 0x90;
    if (lead == 0xF4) high = 0x8F;
  } else {
    return 0;
  }
  if (byte(at + 1) < low || byte(at + 1) > high) return 0;
  for (size_t i = 2; i < length; ++i) {
    if (byte(at + i) < 0x80 || byte(at + i) > 0xBF) return 0;
  }
  return length;
}

// `text` with control characters written as \n, \t or \xNN, and so each byte that is not
// part of well-formed UTF-8 (the rest of UTF-8 kept as it is): a key or line quoted from a bad file can never break the one
// line an error is printed on, nor the terminal that shows it.
inline std::string one_line(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (size_t at = 0; at < text.size(); ++at) {
    const auto c = static_cast<unsigned char>(text[at]);
    if (c >= 0x80) {
      // U+0080..U+009F are control characters too (U+009B opens a terminal's commands).
      const bool control = c == 0xC2 && at + 1 < text.size() && static_cast<unsigned char>(text[at + 1]) < 0xA0;
      if (const size_t length = utf8_sequence(text, at); length > 0 && !control) {
        out.append(text, at, length);
        at += length - 1;
        continue;
      }
    }
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      char code[5];
      std::snprintf(code, sizeof code, "\\x%02x", c);
      out += code;
    }
  }
  return out;
}

// The most bytes a line keeps of text that may be any size (a value quoted from a file, a
// policy's log): kMaxLineBytes of `text`, cut between UTF-8 characters, then "... (`total`
// bytes in all)".
inline constexpr size_t kMaxLineBytes = 4096;
inline std::string cut_line(std::string text, size_t total, size_t max_bytes = kMaxLineBytes) {
  if (total <= max_bytes && text.size() <= max_bytes) return text;
  size_t cut = std::min(text.size(), max_bytes);
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // inside a character
  text.resize(cut);
  return text + "... (" + std::to_string(total) + " bytes in all)";
}

// An exception's text up to its first line break: c10::Error's runs on with a backtrace.
inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

// A message as one printable line of at most kMaxMessageBytes: room for a line cut at
// kMaxLineBytes and the context that names where it came from, so it is not cut twice. A
// longer one keeps its start and its end, cut between UTF-8 characters: a message names where
// it came from first and says what is wrong last, and a value quoted whole in the middle must
// not push the reason out.
inline constexpr size_t kMaxMessageBytes = 2 * kMaxLineBytes;
inline std::string message_line(const std::string& text) {
  std::string line = one_line(text);
  if (line.size() <= kMaxMessageBytes) return line;
  const auto inside_character = [&](size_t at) { return (static_cast<unsigned char>(line[at]) & 0xC0) == 0x80; };
  const size_t keep = (kMaxMessageBytes - 64) / 2;  // 64: room for the words that mark the cut
  size_t head = keep;
  while (head > 0 && inside_character(head)) --head;
  size_t tail = line.size() - keep;
  while (tail < line.size() && inside_character(tail)) ++tail;
  return line.substr(0, head) + " ... (" + std::to_string(tail - head) + " bytes left out) ... " + line.substr(tail);
}

// The host allocator's refusal, from its message: LibTorch reports it as a plain c10::Error
// (a device's as OutOfMemoryError), so its own words are the one sign of it. Like a device's,
// it is the run asking more than the machine has, which smaller batches or more ranks fix.
inline std::optional<std::string> host_allocation_refused(const std::string& message) {
  constexpr std::string_view kAllocator = "DefaultCPUAllocator: ";
  const auto at = message.find(kAllocator);
  if (at == std::string::npos) return std::nullopt;
  return message.substr(at + kAllocator.size());
}

// The words of a rank's error that make it the consequence of another rank's failure: the
// launcher reports the rank whose error says why in preference to one that says this.
inline constexpr const char* kAnotherRankFailed = "another rank failed";

class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& message) : std::runtime_error(message_line(message)) {}
};

// A UserError that every rank of a run raises alike before any collective of the call: agreed
// by a collective, or decided by state every rank holds alike (offloaded, inside a backward,
// the step count). The ranks stay in step, and the run may go on.
class EveryRankError : public UserError {
 public:
  using UserError::UserError;
};

}  // namespace fsdpp
