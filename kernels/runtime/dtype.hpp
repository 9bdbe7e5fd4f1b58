// Element types a Tensor can hold.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ostream>

namespace kernels {

enum class DType : uint8_t { f32, f16, bf16, i32, i64, u8 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f16:
      return 2;
    case DType::bf16:
      return 2;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    case DType::bf16:
      return "bf16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

inline bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f16 || t == DType::bf16;
}

inline std::ostream& operator<<(std::ostream& os, DType t) {
  return os << dtype_name(t);
}

// Host-side conversions for the 16-bit float formats (round to nearest even). The bf16 pair is
// inline: CPU kernels convert element by element in their loops.
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// A NaN keeps its sign and top payload bits, quieted. A select, not a branch, so that a loop of it
// vectorises (a branch per element made an f32 -> bf16 cast 7x slower than the widening one).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

}  // namespace kernels
