// Builds a config from text, a model from the registry, and runs one training step. Also uses
// std::filesystem, which the pip wheel's libtorch.so would replace with crashing copies were it
// not for the link order that train::train gives the program.
#include <train/config.h>
#include <train/models/model.h>
#include <train/optim.h>

#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <string>

#include <unistd.h>

int main() {
  const train::Config config = train::parse_config(
      "model: {name: resnet18, in_channels: 1, width: 0.125, small_input: true}\n"
      "data: {kind: synthetic, channels: 1, image_size: 16}\n"
      "trainer: {global_batch: 4, max_steps: 1}\n",
      "downstream.yaml");
  auto model = train::models::make_model(config.model);
  auto optimizer = train::make_optimizer(config.optim, *model, config.optim.lr);
  auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({4, 1, 16, 16})),
                                                   torch::tensor({0, 1, 2, 3}));
  loss.backward();
  optimizer->step();
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("train-downstream-" + std::to_string(::getpid())) / "a" / "b";
  if (!std::filesystem::create_directories(dir) ||
      std::filesystem::remove_all(dir.parent_path().parent_path()) != 3) {
    std::cerr << "std::filesystem failed on " << dir << "\n";
    return 1;
  }
  std::cout << "downstream OK: " << train::models::count_parameters(*model) << " parameters, loss "
            << loss.item<double>() << "\n";
  return 0;
}
