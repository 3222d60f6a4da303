class AnthropicRoutes:
    def __init__(self, door):
        self.door = door
