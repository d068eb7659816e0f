int dummy_resnet_torch;
