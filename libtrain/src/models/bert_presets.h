#pragma once
// The BERT size presets (model.preset), without LibTorch: BertOptions::preset builds from this
// table, and the config validates model.hidden_size / model.heads against it before any model is
// built. Internal header.
#include <cstdint>
#include <string>

namespace train::models::detail {

struct BertPresetSizes {
  const char* name;
  int64_t layers;
  int64_t hidden;
  int64_t heads;
};

// Intermediate size 4 x hidden, 512 positions, vocab 30522 for every preset.
constexpr BertPresetSizes kBertPresets[] = {
    {"bert-base", 12, 768, 12},  {"bert-small", 4, 512, 8}, {"bert-mini", 4, 256, 4},
    {"bert-tiny", 2, 128, 2},    {"minilm-l6", 6, 384, 12},
};
constexpr int64_t kBertPresetVocab = 30522;
constexpr int64_t kBertPresetPositions = 512;

inline const BertPresetSizes* find_bert_preset(const std::string& name) {
  for (const BertPresetSizes& p : kBertPresets) {
    if (name == p.name) return &p;
  }
  return nullptr;
}

// The registry names of the BERT models, whose sizes come from model.preset and the model.* keys.
inline bool is_bert_model(const std::string& name) {
  return name == "bert" || name == "bert-mlm" || name == "bert-classifier";
}

}  // namespace train::models::detail
