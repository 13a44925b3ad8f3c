"""meshnode.node"""
