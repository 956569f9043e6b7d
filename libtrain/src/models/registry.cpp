#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "suggest.h"
#include "train/config.h"
#include "train/errors.h"
#include "train/models/model.h"
#include "train/models/bert.h"
#include "train/models/resnet.h"
#include "train/models/small.h"

namespace train::models {
namespace {

struct Entry {
  ModelBuilder builder;
  std::string summary;  // one line for listings
};

// Name -> entry, sorted by name so listings and error messages are stable. Built-ins are added
// by the constructor.
struct Registry {
  Registry() {
    entries["resnet18"] = {[](const ModelConfig& c) { return make_resnet(18, c); },
                           "ResNet-18 (torchvision layout, BasicBlock x [2, 2, 2, 2])"};
    entries["resnet34"] = {[](const ModelConfig& c) { return make_resnet(34, c); },
                           "ResNet-34 (torchvision layout, BasicBlock x [3, 4, 6, 3])"};
    entries["resnet50"] = {[](const ModelConfig& c) { return make_resnet(50, c); },
                           "ResNet-50 v1.5 (torchvision layout, Bottleneck x [3, 4, 6, 3])"};
    entries["bert"] = {[](const ModelConfig& c) { return make_bert(BertHead::kNone, c); },
                       "BERT encoder (Hugging Face BertModel names); returns hidden states"};
    entries["bert-mlm"] = {[](const ModelConfig& c) { return make_bert(BertHead::kMaskedLM, c); },
                           "BERT with the masked-LM head (logits [B, T, vocab]; sizes from model.preset)"};
    entries["bert-classifier"] = {[](const ModelConfig& c) { return make_bert(BertHead::kClassifier, c); },
                                  "BERT with the pooler and a sequence-classification head (model.num_classes)"};
    entries["mlp"] = {make_mlp, "MLP 784-512-512-classes with ReLU, for 28x28 images"};
    entries["lenet"] = {make_lenet, "LeNet-style CNN (conv 6, conv 16, FC 120-84-classes), for 28x28 images"};
  }

  std::mutex mutex;
  std::map<std::string, Entry> entries;
};

// Created on first use; C++11 guarantees this runs exactly once even with concurrent first
// calls, and it sidesteps static-initialisation order across translation units.
Registry& registry() {
  static Registry instance;
  return instance;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

}  // namespace

// A later registration under an existing name replaces the earlier one, so users can override a
// built-in.
void register_model(const std::string& name, ModelBuilder builder, const std::string& summary) {
  if (name.empty()) throw std::invalid_argument("register_model: empty model name");
  if (!builder) throw std::invalid_argument("register_model: empty builder for '" + name + "'");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries[name] = {std::move(builder), summary};
}

ModelPtr make_model(const ModelConfig& config) {
  ModelBuilder builder;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    const auto it = r.entries.find(config.name);
    if (it != r.entries.end()) builder = it->second.builder;
  }
  if (!builder) {
    const std::vector<std::string> known = model_names();
    const std::string suggestion = detail::closest_match(config.name, known);
    std::string message = "key 'model.name': unknown model '" + config.name + "'; ";
    if (!suggestion.empty()) message += "did you mean '" + suggestion + "'? ";
    throw ConfigError(message + "known: " + join(known));
  }
  // Built outside the lock: building can be slow, and a builder may itself use the registry.
  // A builder rejects sizes it cannot build with std::invalid_argument: a config error. (The
  // config's own checks catch the known cases first, naming the exact key.)
  ModelConfig fresh = config;  // model.options: counts what this builder asks for
  fresh.options = ModelOptions(config.options.values());
  ModelPtr model;
  try {
    model = builder(fresh);
  } catch (const std::invalid_argument& e) {
    throw ConfigError("key 'model.name': cannot build '" + config.name + "' from the model.* keys: " + e.what());
  }
  if (!model) throw Error("model builder for '" + config.name + "' returned no model");
  // An option the builder never asked for changed nothing: most likely a misspelt name.
  if (const std::vector<std::string> unasked = fresh.options.unasked(); !unasked.empty()) {
    const std::vector<std::string> asked(fresh.options.asked().begin(), fresh.options.asked().end());
    const std::string suggestion = detail::closest_match(unasked.front(), asked);
    throw ConfigError("key 'model.options." + unasked.front() + "': model '" + config.name +
                      "' does not read this option" +
                      (!suggestion.empty() ? "; did you mean '" + suggestion + "'?" : std::string()) +
                      (asked.empty() ? " (it reads no options)" : " (it reads: " + join(asked) + ")"));
  }
  return model;
}

std::vector<std::string> model_names() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  std::vector<std::string> names;
  names.reserve(r.entries.size());
  for (const auto& entry : r.entries) names.push_back(entry.first);
  return names;
}

bool has_model(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.entries.count(name) > 0;
}

}  // namespace train::models
