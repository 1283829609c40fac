"""Hugging Face checkpoints: conversion to and from the trainer's model."""
